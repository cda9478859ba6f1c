"""bench steady against the fake server: window counting, per-stream rates, concurrency totals."""

from __future__ import annotations

import json

INTERVAL = 0.005
OUTPUT = 40


def test_steady_levels(fake, bench, tmp_path):
    out = tmp_path / "steady.json"
    with fake(pp_rate=1e6, token_interval=INTERVAL) as server:
        rc, stdout, _ = bench("steady", "--base-url", server.url, "--concurrency", 1, 3, "--input-len", 32,
                              "--output-len", OUTPUT, "--warmup", 0.2, "--duration", 1.0, "--repeats", 2,
                              "--save-result", out, "--plot", tmp_path / "steady.png")
        assert server.max_active == 3
    assert rc == 0
    data = json.loads(out.read_text())
    one, three = data["levels"]
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 3]
    # decode gaps are the server's interval; a stream restarts at once, so it is always in a
    # request: OUTPUT tokens per first-token wait plus (OUTPUT - 1) gaps, as measured (the wait
    # is the client's and server's own overhead here, and grows on a loaded machine)
    assert abs(one["itl_ms"]["mean"] - INTERVAL * 1000) <= 0.05 * INTERVAL * 1000
    ceiling = OUTPUT / ((OUTPUT - 1) * INTERVAL)
    for lv in (one, three):
        per_request = (lv["ttft_ms"]["mean"] + (OUTPUT - 1) * lv["itl_ms"]["mean"]) / 1000
        assert 0.92 * OUTPUT / per_request <= lv["per_stream_tps"]["mean"] <= 1.03 * ceiling
        assert len(lv["total_tps"]["values"]) == 2  # one value per repeat
    assert abs(three["total_tps"]["mean"] - 3 * one["total_tps"]["mean"]) <= 0.08 * 3 * one["total_tps"]["mean"]
    assert abs(three["total_tps"]["mean"] - 3 * three["per_stream_tps"]["mean"]) < 1e-6
    lines = [" ".join(line.split()) for line in stdout.splitlines()]
    assert lines[0].startswith("| concurrency | total t/s | per-stream t/s | TTFT mean (ms) | TTFT p50 (ms)")
    assert lines[2].startswith("| c1 |") and "±" in lines[2]
    assert (tmp_path / "steady.png").exists()

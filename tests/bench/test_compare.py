"""bench compare: the Change column, ≈ within the combined std, the three JSON dialects."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.llama_benchy_run import run_llama_benchy
from tokenmill.bench.compare import Value, change, load

FIXTURES = Path(__file__).parent / "fixtures"


def depth_json(path: Path, pp: float, pp_std: float, tg: float, tg_std: float, tool: bool = True) -> Path:
    def m(mean: float, std: float) -> dict:
        return {"mean": mean, "std": std, "values": [mean - std, mean + std]}

    run = {"concurrency": 1, "context_size": 4096, "prompt_size": 2048, "response_size": 32,
           "is_context_prefill_phase": False, "pp_throughput": m(pp, pp_std), "pp_req_throughput": m(pp, pp_std),
           "tg_throughput": m(tg, tg_std), "tg_req_throughput": m(tg, tg_std), "peak_throughput": m(tg, tg_std),
           "peak_req_throughput": m(tg, tg_std), "ttfr": m(300, 1), "est_ppt": m(290, 1), "e2e_ttft": m(310, 1)}
    data = {"version": "0.4.0", "model": "m", "max_concurrency": 1, "benchmarks": [run]}
    if tool:
        data.update(tool="tokenmill bench", mode="depth")
    path.write_text(json.dumps(data))
    return path


def rows(stdout: str) -> dict[str, list[str]]:
    out = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4:
            out[cells[0]] = cells[1:]
    return out


def test_change_column_on_two_runs(bench, tmp_path):
    a = depth_json(tmp_path / "a.json", 6541.13, 103.36, 50.0, 0.5)
    b = depth_json(tmp_path / "b.json", 6600.00, 90.00, 45.0, 0.4)
    rc, stdout, _ = bench("compare", a, b)
    assert rc == 0
    assert " ".join(stdout.splitlines()[2].split()) == "| Test | A | B | Change |"
    table = rows(stdout)
    assert table["pp2048 @ d4096"] == ["6541.13 ± 103.36", "6600.00 ± 90.00", "+0.90% ≈"]
    assert table["tg32 @ d4096"] == ["50.00 ± 0.50", "45.00 ± 0.40", "-10.00% worse"]
    rc, stdout, _ = bench("compare", b, a, "--fail-on-regression", 5)
    assert rc == 0 and rows(stdout)["tg32 @ d4096"][2] == "+11.11% better"
    rc, stdout, _ = bench("compare", a, b, "--fail-on-regression", 5)
    assert rc == 1 and "Regression beyond 5%: tg32 @ d4096 (-10.00%)" in stdout
    rc, _, _ = bench("compare", a, b, "--fail-on-regression", 15)
    assert rc == 0


def test_direction_and_noise():
    assert change(Value(100, 0, False), Value(90, 0, False)) == ("-10.00% better", False)
    assert change(Value(100, 3, True), Value(104, 4, True)) == ("+4.00% ≈", False)  # |4| <= hypot(3, 4) = 5
    assert change(Value(100, 3, True), Value(94, 4, True)) == ("-6.00% worse", True)


def test_reads_recorded_llama_benchy_and_vllm(bench, tmp_path):
    tests, desc = load(str(FIXTURES / "llama_benchy_0.4.0.json"))
    assert desc.startswith("llama-benchy 0.4.0")
    assert {"pp512", "tg32", "pp512 (c2)", "tg32 @ d512 (c2)"} <= set(tests)
    vllm, desc = load(str(FIXTURES / "vllm_serve_result.json"))
    assert desc.startswith("vLLM serve")
    assert vllm["mean TTFT (ms)"].std > 0 and not vllm["mean TTFT (ms)"].higher_is_better
    assert vllm["output throughput (tok/s)"].higher_is_better
    rc, stdout, _ = bench("compare", FIXTURES / "vllm_serve_result.json", FIXTURES / "vllm_serve_result.json")
    assert rc == 0 and "+0.00% ≈" in stdout


def test_our_serve_json_against_vllm_json(fake, bench, tmp_path):
    out = tmp_path / "ours.json"
    with fake(pp_rate=50000.0, token_interval=0.002) as server:
        rc, _, _ = bench("serve", "--base-url", server.url, "--num-prompts", 4, "--input-len", 64,
                         "--output-len", 8, "--save-result", out)
    assert rc == 0
    rc, stdout, _ = bench("compare", FIXTURES / "vllm_serve_result.json", out)
    table = rows(stdout)
    assert rc == 0 and "mean TPOT (ms)" in table and table["mean TPOT (ms)"][2].endswith(("better", "worse", "≈"))


@pytest.mark.skipif(importlib.util.find_spec("llama_benchy") is None, reason="llama-benchy not installed")
def test_live_llama_benchy_json_is_read(fake, bench, tmp_path):
    """Run the real llama-benchy against the fake server, then compare its JSON with ours."""
    theirs, ours = tmp_path / "llama_benchy.json", tmp_path / "ours.json"
    with fake(pp_rate=20000.0, token_interval=0.002) as server:
        proc = run_llama_benchy(server.url, theirs, tmp_path / "home",
                                ["--pp", "256", "--tg", "16", "--runs", "1", "--skip-coherence"])
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        rc, _, _ = bench("depth", "--base-url", server.url, "--pp", 256, "--tg", 16, "--runs", 1,
                         "--save-result", ours)
    assert rc == 0
    rc, stdout, _ = bench("compare", theirs, ours)
    table = rows(stdout)
    assert rc == 0 and set(table) >= {"pp256", "tg16"}
    assert table["tg16"][2].endswith(("better", "worse", "≈"))


def test_unreadable_files(bench, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    rc, _, err = bench("compare", bad, bad)
    assert rc == 2 and "not a tokenmill, llama-benchy or vLLM benchmark result" in err
    rc, _, err = bench("compare", tmp_path / "missing.json", bad)
    assert rc == 2 and "cannot read" in err and "Traceback" not in err

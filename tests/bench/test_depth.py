"""bench depth against the fake server: llama-benchy's rates, names, columns and JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

PP_RATE = 5000.0  # fake prefill: prompt tokens per second (1024 tokens: ~0.2 s)
INTERVAL = 0.005  # fake decode: seconds per token, i.e. 200 t/s per stream
CONCURRENT_TOL = 0.10
FIXTURE = Path(__file__).parent / "fixtures" / "llama_benchy_0.4.0.json"


def within(value: float, expected: float, tol: float = 0.05) -> bool:
    return abs(value - expected) <= tol * expected


def test_rates_and_concurrency_totals(fake, bench, tmp_path):
    out = tmp_path / "depth.json"
    with fake(pp_rate=PP_RATE, token_interval=INTERVAL, latency=0.01) as server:
        # 256 tokens: the batch span is long enough that start-up jitter stays well inside 5%.
        rc, stdout, _ = bench("depth", "--base-url", server.url, "--pp", 1024, "--tg", 256,
                              "--concurrency", 1, 3, "--runs", 2, "--save-result", out)
        assert server.max_active == 3
    assert rc == 0
    data = json.loads(out.read_text())
    runs = {b["concurrency"]: b for b in data["benchmarks"]}
    latency = data["latency_ms"] / 1000
    one, three = runs[1], runs[3]
    # single stream: est_ppt = ttfr - latency, pp = prompt tokens / est_ppt; tg = 1 / interval
    assert within(one["pp_throughput"]["mean"], PP_RATE)
    assert within(one["tg_throughput"]["mean"], 1 / INTERVAL)
    # three together: per request the same rates; totals over the batch's span. Three streams
    # start within a few ms of each other on a 2-core machine, and a span of ~0.2 s moves by
    # that much, so these allow 10% (a wrong formula is off by about 3x).
    assert within(three["pp_req_throughput"]["mean"], PP_RATE, CONCURRENT_TOL)
    assert within(three["tg_req_throughput"]["mean"], 1 / INTERVAL, CONCURRENT_TOL)
    assert within(three["tg_throughput"]["mean"], 3 / INTERVAL, CONCURRENT_TOL)
    prompt = three["requests"][0][0]["prompt_tokens"]
    assert within(prompt, 1024, 0.12)  # sized by the local tokenizer, calibrated on the server's usage
    assert within(three["pp_throughput"]["mean"], 3 * prompt / (latency + prompt / PP_RATE), CONCURRENT_TOL)
    assert len(three["pp_throughput"]["values"]) == 2  # warm-up run discarded
    assert "| pp1024 (c1) |" in " ".join(stdout.split())


def test_serial_prefill_totals(fake, bench, tmp_path):
    """When the server prefills one request at a time, the batch total stays at one rate."""
    out = tmp_path / "depth.json"
    with fake(pp_rate=PP_RATE, token_interval=INTERVAL, serial_prefill=True) as server:
        rc, _, _ = bench("depth", "--base-url", server.url, "--pp", 700, "--tg", 4, "--concurrency", 3,
                         "--runs", 1, "--latency-mode", "none", "--skip-coherence", "--save-result", out)
    assert rc == 0
    run = json.loads(out.read_text())["benchmarks"][0]
    assert within(run["pp_throughput"]["mean"], PP_RATE)


def test_names_columns_and_llama_benchy_keys(fake, bench, tmp_path):
    out = tmp_path / "depth.json"
    with fake(pp_rate=10000.0, token_interval=0.001) as server:
        rc, stdout, _ = bench("depth", "--base-url", server.url, "--pp", 64, "--tg", 8, "--depth", 0, 128,
                              "--concurrency", 1, 2, "--runs", 2, "--latency-mode", "generation",
                              "--save-result", out, "--plot", tmp_path / "depth.png")
        bodies = list(server.bodies)
    assert rc == 0
    lines = [" ".join(line.split()) for line in stdout.splitlines()]
    assert lines[0] == ("| model | test | t/s (total) | t/s (req) | peak t/s | peak t/s (req) | ttfr (ms) "
                        "| est_ppt (ms) | e2e_ttft (ms) |")
    names = [line.split(" | ")[1] for line in lines[2:] if line.startswith("| fake/model")]
    assert names == ["pp64 (c1)", "tg8 (c1)", "pp64 (c2)", "tg8 (c2)",
                     "pp64 @ d128 (c1)", "tg8 @ d128 (c1)", "pp64 @ d128 (c2)", "tg8 @ d128 (c2)"]
    data = json.loads(out.read_text())
    ref = json.loads(FIXTURE.read_text())
    assert set(ref) <= set(data)
    assert set(ref["benchmarks"][0]) <= set(data["benchmarks"][0])
    assert data["latency_mode"] == "generation" and data["max_concurrency"] == 2
    assert (tmp_path / "depth.png").read_bytes()[:4] == b"\x89PNG"
    # cold prefill: every measured request opens with its own nonce; context in a system message
    streamed = [b for b in bodies if b.get("stream") and b.get("max_tokens") == 8]
    firsts = [b["messages"][0]["content"][:10] for b in streamed]
    assert len(set(firsts)) == len(firsts)
    assert any(b["messages"][0]["role"] == "system" for b in streamed)
    assert all(b["stream_options"] == {"include_usage": True} and b["return_token_ids"] for b in streamed)


def test_single_concurrency_markdown_is_llama_benchy_layout(fake, bench):
    with fake(pp_rate=200000.0, token_interval=0.001) as server:
        rc, stdout, _ = bench("depth", "--base-url", server.url, "--pp", 32, "--tg", 4, "--runs", 1)
    assert rc == 0
    lines = stdout.splitlines()
    assert " ".join(lines[0].split()) == "| model | test | t/s | peak t/s | ttfr (ms) | est_ppt (ms) | e2e_ttft (ms) |"
    assert lines[1].startswith("|:") and lines[1].endswith(":|")
    assert "pp32 |" in lines[2] and "±" in lines[2]


@pytest.mark.parametrize("fmt,check", [("csv", "model,test_name,t_s_mean,t_s_std"), ("json", '"benchmarks"')])
def test_formats(fake, bench, fmt, check):
    with fake(pp_rate=200000.0, token_interval=0.001) as server:
        rc, stdout, _ = bench("depth", "--base-url", server.url, "--pp", 32, "--tg", 4, "--runs", 1,
                              "--no-warmup", "--skip-coherence", "--format", fmt)
    assert rc == 0 and check in stdout

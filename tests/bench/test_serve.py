"""bench serve against the fake server: vLLM's metrics, keys, arrivals and concurrency cap."""

from __future__ import annotations

import json
import math
import random

from tokenmill.bench.serve import arrival_times

INTERVAL = 0.005
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
    "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
}


def within(value: float, expected: float, tol: float = 0.05) -> bool:
    return abs(value - expected) <= tol * expected


def test_burst_with_concurrency_cap(fake, bench, tmp_path):
    out = tmp_path / "serve.json"
    with fake(pp_rate=20000.0, token_interval=INTERVAL) as server:
        rc, stdout, _ = bench("serve", "--base-url", server.url, "--num-prompts", 8, "--input-len", 400,
                              "--output-len", 60, "--max-concurrency", 2, "--goodput", "tpot:1000", "ttft:2000",
                              "--save-result", out, "--plot", tmp_path / "serve.png")
        assert server.max_active == 2
    assert rc == 0
    assert "============ Serving Benchmark Result ============" in stdout
    assert "Mean TPOT (ms):" in stdout and "P99 ITL (ms):" in stdout and "P90 E2EL (ms):" in stdout
    r = json.loads(out.read_text())
    assert VLLM_KEYS <= set(r)
    assert r["completed"] == 8 and r["failed"] == 0 and r["max_concurrency"] == 2
    assert r["total_output_tokens"] == 8 * 60 and r["output_lens"] == [60] * 8
    assert r["max_concurrent_requests"] == 2
    assert within(r["median_tpot_ms"], INTERVAL * 1000)
    assert within(r["mean_itl_ms"], INTERVAL * 1000)  # timer jitter makes single gaps bimodal
    assert r["request_goodput"] == r["request_throughput"]  # generous SLOs: every request is good
    # two streams busy all the time: about two requests per mean end-to-end latency
    assert within(r["request_throughput"], 2 / (r["mean_e2el_ms"] / 1000), 0.15)
    assert (tmp_path / "serve.png").stat().st_size > 1000


def test_poisson_rate_sweep_and_goodput(fake, bench, tmp_path):
    out = tmp_path / "sweep.json"
    with fake(pp_rate=50000.0, token_interval=0.002) as server:
        rc, stdout, _ = bench("serve", "--base-url", server.url, "--num-prompts", 10, "--input-len", 64,
                              "--output-len", 8, "--request-rate", 40, "--max-concurrency", 1, 4, "--seed", 1,
                              "--goodput", "tpot:0.001", "--metric-percentiles", "50,99.9", "--save-result", out)
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "serve" and [r["max_concurrency"] for r in data["runs"]] == [1, 4]
    for r in data["runs"]:
        assert r["request_rate"] == 40.0 and r["burstiness"] == 1.0
        assert r["request_goodput"] == 0.0  # nobody meets a 1 µs TPOT
        assert "p99.9_ttft_ms" in r and "p50_itl_ms" in r
        assert r["duration"] >= 10 / 40 * 0.9  # arrivals spread over n / rate seconds
    assert "| max concurrency |" in " ".join(stdout.split())


def test_arrival_times():
    rng = random.Random(0)
    assert arrival_times(5, math.inf, 1.0, rng) == [0.0] * 5
    even = arrival_times(4, 2.0, math.inf, rng)
    assert even == [0.5, 1.0, 1.5, 2.0]
    poisson = arrival_times(1000, 50.0, 1.0, rng)
    assert math.isclose(poisson[-1], 1000 / 50.0)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    cv = (sum((g - 0.02) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.02
    assert 0.85 < cv < 1.15  # exponential gaps: coefficient of variation 1
    bursty = arrival_times(1000, 50.0, 0.25, rng)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert (sum((g - 0.02) ** 2 for g in bgaps) / len(bgaps)) ** 0.5 / 0.02 > 1.5

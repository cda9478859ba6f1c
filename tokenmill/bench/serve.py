"""`bench serve`: vLLM's serving benchmark (benchmark_serving / `vllm bench serve`).

Requests arrive as a Poisson process (burstiness 1), a gamma process (other burstiness) or
all at once (rate inf), at most `max_concurrency` in flight. Metrics and result keys follow
vLLM: TTFT is the first chunk with a choice, TPOT = (E2E - TTFT) / (output tokens - 1), ITL
the gaps between chunks, E2E the whole request; goodput counts requests meeting every SLO.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.bench.client import Client
from tokenmill.bench.errors import BenchError
from tokenmill.bench.failures import Failures
from tokenmill.bench.progress import Progress
from tokenmill.bench.record import RequestRecord, finalize
from tokenmill.bench.sizing import PromptSizer, messages
from tokenmill.bench.stats import summarize

METRIC_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


@dataclass
class ServeConfig:
    num_prompts: int = 200
    input_len: int = 1024
    output_len: int = 128
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    percentile_metrics: list[str] = field(default_factory=lambda: ["ttft", "tpot", "itl", "e2el"])
    percentiles: list[float] = field(default_factory=lambda: [90.0, 99.0])
    ignore_eos: bool = True
    num_warmups: int = 1
    seed: int | None = None


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Cumulative send times; a finite rate is rescaled so the last arrival is at n / rate
    (vLLM does the same to steady throughput across seeds)."""
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * n
    else:
        theta = 1.0 / (rate * burstiness)
        gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    times = list(np.cumsum(gaps))
    if times and times[-1] > 0:
        scale = (n / rate) / times[-1]
        times = [t * scale for t in times]
    return [float(t) for t in times]


def _payload(context: str, prompt: str, cfg: ServeConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages(context, prompt), "max_tokens": cfg.output_len,
                            "return_token_ids": True}
    if cfg.ignore_eos:
        body.update(ignore_eos=True, min_tokens=cfg.output_len)
    return body


async def run_serve(client: Client, sizer: PromptSizer, cfg: ServeConfig, progress: Progress,
                    failures: Failures) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    prompts = [sizer.pair(cfg.input_len, 0) for _ in range(cfg.num_prompts)]
    expected = cfg.input_len
    for _ in range(cfg.num_warmups):
        warm = await client.stream_chat(_payload(*sizer.pair(cfg.input_len, 0), cfg))
        if not warm.ok:
            raise BenchError(f"warm-up request failed: {warm.error}")
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    arrivals = arrival_times(cfg.num_prompts, cfg.request_rate, cfg.burstiness, rng)
    queue_times: list[float] = [0.0] * cfg.num_prompts
    records: list[RequestRecord] = [RequestRecord() for _ in prompts]

    async def one(i: int) -> None:
        arrived = time.perf_counter()
        if limit is not None:
            async with limit:
                await send(i, arrived)
        else:
            await send(i, arrived)

    async def send(i: int, arrived: float) -> None:
        queue_times[i] = time.perf_counter() - arrived
        await client.stream_chat(_payload(*prompts[i], cfg), record=records[i])
        finalize(records[i], sizer.count_output)
        failures.add(records[i])
        progress.update()

    progress.start(cfg.num_prompts, f"serve c={cfg.max_concurrency or 'inf'} rate={cfg.request_rate:g}")
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        progress.close()
    duration = time.perf_counter() - t0
    result = calculate(records, expected, duration, cfg, t0)
    result["queue_times"] = queue_times
    return result


def _e2e(r: RequestRecord) -> float:
    return (r.last_data or r.end) - r.start


def _peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """(most output tokens in any whole second since the first request, peak in-flight)."""
    if not ok:
        return 0.0, 0
    origin = min(r.start for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for t in r.token_times:
            buckets[int(t - origin)] = buckets.get(int(t - origin), 0) + 1
    events = sorted([(r.start, 1) for r in ok] + [(r.start + _e2e(r), -1) for r in ok], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return float(max(buckets.values(), default=0)), peak


def calculate(records: list[RequestRecord], expected_input: int, duration: float, cfg: ServeConfig,
              origin: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    good = 0
    for r in ok:
        ttft = (r.first_response or r.end) - r.start
        e2e = _e2e(r)
        tpot = (e2e - ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(ttft)
        e2els.append(e2e)
        itls.extend(r.itls())
        slo = {"ttft": ttft, "tpot": tpot, "e2el": e2e}
        if cfg.goodput and all(slo[k] * 1000 <= v for k, v in cfg.goodput.items()):
            good += 1
    total_in = sum(r.prompt_len(expected_input) for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_conc = _peaks(ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if cfg.goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len(expected_input) if r.ok else 0 for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [((r.first_response or r.end) - r.start) if r.ok else 0.0 for r in records],
        "itls": [r.itls() if r.ok else [] for r in records],
        "latencies": [_e2e(r) if r.ok else 0.0 for r in records],
        "start_times": [r.start - origin for r in records],
        "generated_texts": [r.text for r in records],
        "errors": [r.error or "" for r in records],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_conc,
        "tpots": tpots,
        "token_sources": sorted({r.token_source for r in ok}),
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in cfg.percentile_metrics:
        stats = summarize(values[name], cfg.percentiles, 1000)
        for key, v in stats.items():
            out[f"{key}_{name}_ms"] = v
    return out

"""`bench steady`: steady-state decode throughput at fixed concurrency levels.

N streams each send a request, read it to the end and send the next at once. After a
warm-up, only tokens that arrive inside the measuring window count: total t/s = tokens in
the window / window length, per-stream t/s = total / N. TTFT covers requests started inside
the window, ITL the gaps between chunks that both arrived inside it. Requests still running
when the window closes are cancelled; their tokens inside the window still count.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from tokenmill.bench.client import Client
from tokenmill.bench.failures import Failures
from tokenmill.bench.progress import Progress
from tokenmill.bench.record import RequestRecord, finalize
from tokenmill.bench.sizing import PromptSizer, messages
from tokenmill.bench.stats import Metric, metric, summarize

ERROR_BACKOFF_S = 0.05  # a stream whose request failed waits this long before the next one
DRAIN_S = 0.2  # after a window, let the server see the cancelled requests go before the next


@dataclass
class SteadyConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    input_len: int = 128
    output_len: int = 256
    warmup: float = 20.0
    duration: float = 60.0
    repeats: int = 1
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])


@dataclass
class Window:
    concurrency: int
    tokens: int
    duration: float
    ttfts: list[float]
    itls: list[float]
    completed: int
    started: int

    @property
    def total_tps(self) -> float:
        return self.tokens / self.duration

    @property
    def per_stream_tps(self) -> float:
        return self.total_tps / self.concurrency


@dataclass
class Level:
    concurrency: int
    windows: list[Window]

    def metrics(self) -> dict[str, Metric | None]:
        return {
            "total_tps": metric([w.total_tps for w in self.windows]),
            "per_stream_tps": metric([w.per_stream_tps for w in self.windows]),
            "ttft_mean_ms": metric([sum(w.ttfts) / len(w.ttfts) for w in self.windows if w.ttfts], 1000),
            "itl_mean_ms": metric([sum(w.itls) / len(w.itls) for w in self.windows if w.itls], 1000),
        }

    def to_json(self, percentiles: list[float]) -> dict[str, Any]:
        ttfts = [t for w in self.windows for t in w.ttfts]
        itls = [t for w in self.windows for t in w.itls]
        return {
            "concurrency": self.concurrency,
            **{k: (m.to_json() if m else None) for k, m in self.metrics().items()},
            "ttft_ms": summarize(ttfts, percentiles, 1000),
            "itl_ms": summarize(itls, percentiles, 1000),
            "windows": [
                {"tokens": w.tokens, "duration": w.duration, "total_tps": w.total_tps,
                 "per_stream_tps": w.per_stream_tps, "requests_started": w.started,
                 "requests_completed": w.completed, "ttfts": w.ttfts, "itls": [round(x, 7) for x in w.itls]}
                for w in self.windows
            ],
        }


def _window(records: list[RequestRecord], n: int, w0: float, w1: float) -> Window:
    tokens = 0
    ttfts: list[float] = []
    itls: list[float] = []
    completed = started = 0
    for r in records:
        tokens += sum(1 for t in r.token_times if w0 <= t < w1)
        if w0 <= r.start < w1:
            started += 1
            if r.first_response is not None and r.first_response < w1:
                ttfts.append(r.first_response - r.start)
        if r.ok and w0 <= r.end < w1:
            completed += 1
        inside = [t for t in r.choice_times if w0 <= t < w1]
        itls.extend(b - a for a, b in pairwise(inside))
    return Window(n, tokens, w1 - w0, ttfts, itls, completed, started)


async def run_window(client: Client, sizer: PromptSizer, n: int, cfg: SteadyConfig, progress: Progress,
                     failures: Failures) -> Window:
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    w0 = t0 + cfg.warmup
    w1 = w0 + cfg.duration

    async def stream() -> None:
        while time.perf_counter() < w1:
            context, prompt = sizer.pair(cfg.input_len, 0)
            rec = RequestRecord()
            records.append(rec)
            body = {"messages": messages(context, prompt), "max_tokens": cfg.output_len,
                    "min_tokens": cfg.output_len, "ignore_eos": True, "return_token_ids": True}
            await client.stream_chat(body, record=rec)
            finalize(rec, sizer.count_output)
            failures.add(rec)
            if not rec.ok:
                await asyncio.sleep(ERROR_BACKOFF_S)

    tasks = [asyncio.create_task(stream()) for _ in range(n)]
    progress.start(round((cfg.warmup + cfg.duration) * 10), f"steady c={n}", unit="ds")
    done = 0
    try:
        while (now := time.perf_counter()) < w1:
            await asyncio.sleep(min(0.1, w1 - now))
            step = min(round((time.perf_counter() - t0) * 10), round((cfg.warmup + cfg.duration) * 10)) - done
            progress.update(max(0, step))
            done += max(0, step)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
    await asyncio.sleep(DRAIN_S)
    for r in records:
        if r.error == "cancelled":
            finalize(r, sizer.count_output)
    return _window(records, n, w0, w1)


async def run_steady(client: Client, sizer: PromptSizer, cfg: SteadyConfig, progress: Progress,
                     failures: Failures) -> list[Level]:
    levels: list[Level] = []
    for n in cfg.concurrency:
        windows = [await run_window(client, sizer, n, cfg, progress, failures) for _ in range(cfg.repeats)]
        levels.append(Level(n, windows))
    return levels

"""`bench depth`: llama-benchy's method (pp / tg / depth / concurrency sweeps).

For every (depth, pp, tg, concurrency): one discarded warm-up run, then `runs` measured runs;
each run starts `concurrency` streaming requests together, each with a fresh corpus slice and
a leading nonce (cold prefill). Context goes in a system message before the prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tokenmill.bench.client import Client
from tokenmill.bench.depth_report import DepthRun, aggregate
from tokenmill.bench.errors import BenchError
from tokenmill.bench.failures import Failures
from tokenmill.bench.progress import Progress
from tokenmill.bench.record import RequestRecord, finalize
from tokenmill.bench.sizing import CONTEXT_PROBE_USER, PromptSizer, messages

COHERENCE_PROMPT = "What is the capital of France? Please reply with one word only"


@dataclass
class DepthConfig:
    pp: list[int] = field(default_factory=lambda: [2048])
    tg: list[int] = field(default_factory=lambda: [32])
    depth: list[int] = field(default_factory=lambda: [0])
    concurrency: list[int] = field(default_factory=lambda: [1])
    runs: int = 3
    latency_mode: str = "api"
    no_warmup: bool = False
    skip_coherence: bool = False
    enable_prefix_caching: bool = False
    no_cache: bool = False
    exact_tg: bool = False
    exit_on_first_fail: bool = False
    save_total_throughput_timeseries: bool = False
    save_all_throughput_timeseries: bool = False


@dataclass
class DepthResult:
    model: str
    latency: float
    runs: list[DepthRun]
    config: DepthConfig
    failures: Failures
    max_concurrency: int
    timestamp: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"))


async def measure_latency(client: Client, mode: str) -> float:
    """Mean of three probes: GET /models ('api'), first byte of a 1-token answer
    ('generation'), or 0 ('none')."""
    if mode == "none":
        return 0.0
    samples: list[float] = []
    for _ in range(3):
        if mode == "api":
            value = await client.time_models()
        else:
            value = await client.time_first_byte(
                {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
            )
        if value is not None:
            samples.append(value)
    if not samples:
        raise BenchError(f"latency probe ({mode}) failed three times against {client.base_url}")
    return sum(samples) / len(samples)


async def coherence_ok(client: Client) -> tuple[bool, str]:
    resp = await client.chat({"messages": [{"role": "user", "content": COHERENCE_PROMPT}], "max_tokens": 100,
                              "temperature": 0})
    choices = resp.get("choices") or []
    msg = (choices[0].get("message") or {}) if choices else {}
    text = (msg.get("content") or "") + (msg.get("reasoning_content") or msg.get("reasoning") or "")
    return "paris" in text.lower(), text[:200]


class DepthRunner:
    def __init__(self, client: Client, sizer: PromptSizer, cfg: DepthConfig, progress: Progress) -> None:
        self.client = client
        self.sizer = sizer
        self.cfg = cfg
        self.progress = progress
        self.failures = Failures()

    def _payload(self, context: str, prompt: str, tg: int) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": messages(context, prompt), "max_tokens": tg, "return_token_ids": True}
        if self.cfg.no_cache:
            body["cache_prompt"] = False
        if self.cfg.exact_tg:
            body.update(min_tokens=tg, ignore_eos=True)
        return body

    async def _one(self, context: str, prompt: str, tg: int, counted: bool) -> RequestRecord:
        rec = await self.client.stream_chat(self._payload(context, prompt, tg))
        finalize(rec, self.sizer.count_output)
        if counted:
            self.failures.add(rec)
        self.progress.update()
        return rec

    async def _batch(self, pairs: list[tuple[str, str]], tg: int, counted: bool) -> list[RequestRecord]:
        batch = list(await asyncio.gather(*(self._one(c, p, tg, counted) for c, p in pairs)))
        if counted and self.cfg.exit_on_first_fail:
            first = next((r.error for r in batch if r.error), None)
            if first:
                raise BenchError(f"stopping on the first failed request (--exit-on-first-fail): {first}")
        return batch

    async def run_test(self, pp: int, tg: int, depth: int, c: int, latency: float) -> list[DepthRun]:
        cfg = self.cfg
        cached = cfg.enable_prefix_caching and depth > 0
        ctx_batches: list[list[RequestRecord]] = []
        std_batches: list[list[RequestRecord]] = []
        total = cfg.runs if cfg.no_warmup else cfg.runs + 1
        for i in range(total):
            warmup = not cfg.no_warmup and i == 0
            pairs = [self.sizer.pair(pp, depth) for _ in range(c)]
            if cached:
                loads = await self._batch([(ctx, CONTEXT_PROBE_USER) for ctx, _ in pairs], tg, not warmup)
                if not warmup:
                    ctx_batches.append(loads)
            batch = await self._batch(pairs, tg, not warmup)
            if not warmup:
                std_batches.append(batch)
        keep = (cfg.save_total_throughput_timeseries, cfg.save_all_throughput_timeseries)
        out: list[DepthRun] = []
        if cached:
            out.append(aggregate(DepthRun(c, depth, pp, tg, True), ctx_batches, depth, latency, *keep))
            out.append(aggregate(DepthRun(c, depth, pp, tg, False), std_batches, pp, latency, *keep))
        else:
            out.append(aggregate(DepthRun(c, depth, pp, tg, False), std_batches, pp + depth, latency, *keep))
        return out

    def total_requests(self) -> int:
        cfg = self.cfg
        per_run = sum(cfg.concurrency) * len(cfg.pp) * len(cfg.tg)
        depth_factor = sum(2 if cfg.enable_prefix_caching and d > 0 else 1 for d in cfg.depth)
        return per_run * depth_factor * (cfg.runs + (0 if cfg.no_warmup else 1))

    async def run(self, model: str) -> DepthResult:
        cfg = self.cfg
        if not cfg.skip_coherence:
            ok, text = await coherence_ok(self.client)
            if not ok:
                raise BenchError(
                    f"coherence test failed: expected 'Paris', got {text!r} (--skip-coherence to skip)"
                )
        latency = await measure_latency(self.client, cfg.latency_mode)
        self.progress.write(f"Latency ({cfg.latency_mode}): {latency * 1000:.2f} ms")
        self.progress.start(self.total_requests(), "depth")
        runs: list[DepthRun] = []
        try:
            for depth in cfg.depth:
                for pp in cfg.pp:
                    for tg in cfg.tg:
                        for c in cfg.concurrency:
                            self.progress.describe(f"pp{pp} tg{tg} d{depth} c{c}")
                            runs.extend(await self.run_test(pp, tg, depth, c, latency))
        finally:
            self.progress.close()
        return DepthResult(model, latency, runs, cfg, self.failures, max(cfg.concurrency))

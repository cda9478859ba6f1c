"""Prometheus metrics: per-request histograms observed as tokens arrive, and engine gauges and
counters read from EngineStats when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# EngineStats fields for speculative decoding -> Prometheus counter names (vLLM's, under tokenmill:).
SPEC_FIELDS = {
    "spec_num_drafts": ("tokenmill:spec_decode_num_drafts", "Speculative decoding: verify steps that carried drafts"),
    "spec_num_draft_tokens": ("tokenmill:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed"),
    "spec_num_accepted_tokens": ("tokenmill:spec_decode_num_accepted_tokens",
                                 "Speculative decoding: draft tokens accepted"),
}


def speculative_usage(specs: Iterable[Any]) -> dict[str, Any] | None:
    """The `usage.speculative` object of one API request: its choices' SpecUsage summed, or None
    when none of them ran with speculative decoding."""
    present = [s for s in specs if s is not None]
    if not present:
        return None
    drafts = sum(s.num_drafts for s in present)
    draft_tokens = sum(s.num_draft_tokens for s in present)
    accepted = sum(s.num_accepted_tokens for s in present)
    return {
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
    }


class ServerMetrics:
    """Owns a private registry so several servers can live in one process (tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.requests = Counter(
            "tokenmill:request_success", "Finished requests by finish reason",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds", "Time to first token", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds", "Time between output steps of a request",
            labels, buckets=_ITL_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds", "End-to-end request latency", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_len = Histogram(
            "tokenmill:request_prompt_tokens", "Prompt tokens per request", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.gen_len = Histogram(
            "tokenmill:request_generation_tokens", "Generated tokens per request", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        # The refusal detector (only when it is on): responses judged and refused, by the request's
        # steering strength (rounded to 0.25: a bounded label set) and the signal used.
        refusal_labels = labels + ["strength", "signal"]
        self.refusal_checked = Counter(
            "tokenmill:refusal_checked_responses", "Responses the refusal detector judged, by steering strength",
            refusal_labels, registry=self.registry,
        )
        self.refusal_refused = Counter(
            "tokenmill:refusal_refused_responses", "Responses the refusal detector judged refusals, by steering strength",
            refusal_labels, registry=self.registry,
        )
        self._stats: Any = None
        self.registry.register(_EngineStatsCollector(self))

    def on_refusal_verdict(self, strength: str, signal: str, refused: bool) -> None:
        self.refusal_checked.labels(self.model_name, strength, signal).inc()
        if refused:
            self.refusal_refused.labels(self.model_name, strength, signal).inc()
        else:  # the series exists from the first judged response on, so a rate can be read at once
            self.refusal_refused.labels(self.model_name, strength, signal).inc(0)

    # RequestMetricsSink (called from the engine thread; prometheus_client is thread-safe)
    def on_tokens(self, now: float, previous: float | None, arrival: float) -> None:
        if previous is None:
            self.ttft.labels(self.model_name).observe(now - arrival)
        else:
            self.itl.labels(self.model_name).observe(now - previous)

    def on_request_finished(
        self, finish_reason: str, arrival: float, first_token: float | None, end: float,
        num_prompt_tokens: int, num_generation_tokens: int,
    ) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()
        self.e2e.labels(self.model_name).observe(end - arrival)
        if num_prompt_tokens:
            self.prompt_len.labels(self.model_name).observe(num_prompt_tokens)
        self.gen_len.labels(self.model_name).observe(num_generation_tokens)

    def set_engine_stats(self, stats: Any) -> None:
        self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector:
    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        stats, model = self.owner._stats, self.owner.model_name
        if stats is None:
            return

        def get(name: str) -> float:
            value = getattr(stats, name, 0)
            return float(value) if isinstance(value, (int, float)) else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge("tokenmill:num_requests_running", "Requests in the running batch", get("num_running"))
        yield gauge("tokenmill:num_requests_waiting", "Requests waiting to be scheduled", get("num_waiting"))
        used, total = get("kv_blocks_used"), get("kv_blocks_total")
        yield gauge("tokenmill:kv_cache_blocks_used", "KV-cache blocks in use", used)
        yield gauge("tokenmill:kv_cache_blocks_total", "KV-cache blocks in the pool", total)
        yield gauge("tokenmill:kv_cache_usage_perc", "Fraction of KV-cache blocks in use", used / total if total else 0.0)
        queries, hits = get("prefix_cache_queries"), get("prefix_cache_hits")
        yield counter("tokenmill:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield counter("tokenmill:prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
        hit_rate = hits / queries if queries else 0.0
        yield gauge("tokenmill:prefix_cache_hit_rate", "Prefix-cache hit rate (tokens, cumulative)", hit_rate)
        yield counter("tokenmill:prefix_cache_paged_hits", "Prompt tokens the paged KV alone matched (hybrid models "
                      "resume from the deepest recurrent-state snapshot at or below)", get("prefix_cache_paged_hits"))
        yield counter("tokenmill:state_snapshot_lookups", "Hybrid prefix caching: prefix lookups with a paged hit",
                      get("state_snapshot_lookups"))
        yield counter("tokenmill:state_snapshot_hits", "Hybrid prefix caching: lookups resumed from a state snapshot",
                      get("state_snapshot_hits"))
        yield gauge("tokenmill:state_snapshots_cached", "Recurrent-state snapshots in the pool", get("state_snapshots_cached"))
        yield gauge("tokenmill:state_snapshot_bytes_used", "Bytes of the snapshot pool holding snapshots",
                    get("state_snapshot_bytes_used"))
        yield gauge("tokenmill:state_snapshot_bytes_total", "Bytes of the recurrent-state snapshot pool",
                    get("state_snapshot_bytes_total"))
        yield counter("tokenmill:num_preemptions", "Requests preempted (cumulative)", get("num_preemptions"))
        yield counter("tokenmill:prompt_tokens", "Prompt tokens processed", get("num_prompt_tokens"))
        yield counter("tokenmill:generation_tokens", "Tokens generated", get("num_generation_tokens"))
        for field_name, (name, doc) in SPEC_FIELDS.items():
            yield counter(name, doc, get(field_name))
        drafts, accepted = get("spec_num_drafts"), get("spec_num_accepted_tokens")
        yield gauge("tokenmill:spec_decode_mean_acceptance_length",
                    "Speculative decoding: tokens emitted per verify step with drafts, 1 + accepted / drafts "
                    "(cumulative)", 1.0 + accepted / drafts if drafts else 1.0)
        per_pos = getattr(stats, "spec_num_accepted_tokens_per_pos", None)
        family = CounterMetricFamily(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens by draft position (0 = first draft)",
            labels=["model_name", "position"],
        )
        for pos, value in enumerate(per_pos or []):
            family.add_metric([model, str(pos)], float(value))
        yield family

"""llama-benchy's aggregation, row names, markdown, JSON and CSV for `bench depth`.

Per batch (one run of `concurrency` requests started together): per-request pp t/s =
prompt tokens / est_ppt with est_ppt = ttfr - latency; per-request tg t/s = tokens after the
first / (last token - first token); batch totals use the span of the whole batch; peak t/s is
the most tokens in any 1 s window. At concurrency 1 the t/s column is the per-request value,
above it the batch total. Times are reported in ms; std is the population std.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.record import RequestRecord
from tokenmill.bench.stats import Metric, metric, peak_rate, rate_series, tokens_after_first
from tokenmill.bench.table import pipe_table

METRIC_KEYS = (
    "pp_throughput", "pp_req_throughput", "tg_throughput", "tg_req_throughput",
    "peak_throughput", "peak_req_throughput", "ttfr", "est_ppt", "e2e_ttft",
)


@dataclass
class DepthRun:
    """One test (pp, tg, depth, concurrency): llama-benchy's BenchmarkRun plus raw records."""

    concurrency: int
    context_size: int
    prompt_size: int
    response_size: int
    is_context_prefill_phase: bool
    metrics: dict[str, Metric | None] = field(default_factory=dict)
    throughput_over_time: list[list[list[float]]] | None = None
    requests_throughput_over_time: list[list[list[list[float]]]] | None = None
    requests: list[list[dict[str, Any]]] = field(default_factory=list)
    failed: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "concurrency": self.concurrency,
            "context_size": self.context_size,
            "prompt_size": self.prompt_size,
            "response_size": self.response_size,
            "is_context_prefill_phase": self.is_context_prefill_phase,
        }
        for key in METRIC_KEYS:
            m = self.metrics.get(key)
            out[key] = m.to_json() if m is not None else None
        out["throughput_over_time"] = self.throughput_over_time
        out["requests_throughput_over_time"] = self.requests_throughput_over_time
        out["failed_requests"] = self.failed
        out["requests"] = self.requests
        return out


@dataclass
class _Acc:
    pp: list[float] = field(default_factory=list)
    tg: list[float] = field(default_factory=list)
    ttfr: list[float] = field(default_factory=list)
    est_ppt: list[float] = field(default_factory=list)
    e2e_ttft: list[float] = field(default_factory=list)
    batch_pp: list[float] = field(default_factory=list)
    batch_tg: list[float] = field(default_factory=list)
    peak: list[float] = field(default_factory=list)
    peak_req: list[float] = field(default_factory=list)
    series: list[list[list[float]]] = field(default_factory=list)
    req_series: list[list[list[list[float]]]] = field(default_factory=list)


def _batch(acc: _Acc, batch: list[RequestRecord], expected_prompt: int, latency: float, keep_req_series: bool) -> None:
    ok = [r for r in batch if r.ok]
    if not ok:
        return
    prompt_total = 0
    all_times: list[float] = []
    req_series: list[list[list[float]]] = []
    for r in ok:
        all_times.extend(r.token_times)
        if r.token_times:
            acc.peak_req.append(peak_rate(r.token_times))
        if keep_req_series:
            req_series.append(rate_series(r.token_times) if r.token_times else [])
        prompt = r.prompt_len(expected_prompt)
        prompt_total += prompt
        est_ppt = 0.0
        if r.first_response is not None:
            acc.ttfr.append(r.first_response - r.start)
        if r.first_token is not None:
            e2e = r.first_token - r.start
            acc.e2e_ttft.append(e2e)
            ttfr = (r.first_response or r.first_token) - r.start
            est_ppt = max(0.0, ttfr - latency)
            acc.est_ppt.append(est_ppt)
        if est_ppt > 0:
            acc.pp.append(prompt / est_ppt)
        if r.output_tokens > 1 and len(r.token_times) > 1:
            span = r.token_times[-1] - r.token_times[0]
            n = tokens_after_first(r.token_times)
            if span > 0 and n > 0:
                acc.tg.append(n / span)
    if keep_req_series:
        acc.req_series.append(req_series)
    firsts = [r.first_token for r in ok if r.first_token is not None]
    if firsts:
        start = min(r.start for r in ok)
        pp_span = max(firsts) - start
        if pp_span > 0:
            acc.batch_pp.append(prompt_total / pp_span)
        lasts = [r.token_times[-1] if r.token_times else r.end for r in ok]
        tg_span = max(lasts) - min(firsts)
        decoded = sum(tokens_after_first(r.token_times) for r in ok)
        if tg_span > 0 and decoded > 0:
            acc.batch_tg.append(decoded / tg_span)
    if all_times:
        acc.peak.append(peak_rate(all_times))
        acc.series.append(rate_series(all_times))


def aggregate(
    run: DepthRun,
    batches: list[list[RequestRecord]],
    expected_prompt: int,
    latency: float,
    keep_series: bool = False,
    keep_req_series: bool = False,
) -> DepthRun:
    acc = _Acc()
    for batch in batches:
        _batch(acc, batch, expected_prompt, latency, keep_req_series)
        origin = min((r.start for r in batch), default=0.0)
        run.requests.append([r.to_json(origin) for r in batch])
        run.failed += sum(1 for r in batch if not r.ok)
    single = run.concurrency == 1
    pp = metric(acc.pp if single else acc.batch_pp)
    tg = metric(acc.tg if single else acc.batch_tg)
    run.metrics = {
        "pp_throughput": pp,
        "pp_req_throughput": pp if single else metric(acc.pp),
        "tg_throughput": tg,
        "tg_req_throughput": tg if single else metric(acc.tg),
        "peak_throughput": metric(acc.peak),
        "peak_req_throughput": metric(acc.peak_req),
        "ttfr": metric(acc.ttfr, 1000),
        "est_ppt": metric(acc.est_ppt, 1000),
        "e2e_ttft": metric(acc.e2e_ttft, 1000),
    }
    run.throughput_over_time = acc.series if keep_series else None
    run.requests_throughput_over_time = acc.req_series if keep_req_series else None
    return run


def test_name(kind: str, run: DepthRun, max_concurrency: int) -> str:
    """`pp2048 @ d4096 (c10)`: the suffix only when some test ran above concurrency 1."""
    c = f" (c{run.concurrency})" if max_concurrency > 1 else ""
    if run.is_context_prefill_phase:
        return f"ctx_{kind} @ d{run.context_size}{c}"
    d = f" @ d{run.context_size}" if run.context_size > 0 else ""
    size = run.prompt_size if kind == "pp" else run.response_size
    return f"{kind}{size}{d}{c}"


def rows(runs: list[DepthRun], model: str, max_concurrency: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for run in runs:
        m = run.metrics
        if m.get("pp_throughput"):
            out.append({"model": model, "test_name": test_name("pp", run, max_concurrency),
                        "t_s": m["pp_throughput"], "t_s_req": m["pp_req_throughput"], "peak_ts": None,
                        "peak_ts_req": None, "ttfr": m["ttfr"], "est_ppt": m["est_ppt"], "e2e_ttft": m["e2e_ttft"]})
        if m.get("tg_throughput") or m.get("peak_throughput"):
            out.append({"model": model, "test_name": test_name("tg", run, max_concurrency),
                        "t_s": m["tg_throughput"], "t_s_req": m["tg_req_throughput"], "peak_ts": m["peak_throughput"],
                        "peak_ts_req": m["peak_req_throughput"], "ttfr": None, "est_ppt": None, "e2e_ttft": None})
    return out


def _fmt(m: Metric | None) -> str:
    return m.fmt() if m is not None else ""


def markdown(runs: list[DepthRun], model: str, max_concurrency: int) -> str:
    table = rows(runs, model, max_concurrency)
    if not table:
        return "No results collected. Check if the model is generating tokens."
    if max_concurrency > 1:
        headers = ["model", "test", "t/s (total)", "t/s (req)", "peak t/s", "peak t/s (req)",
                   "ttfr (ms)", "est_ppt (ms)", "e2e_ttft (ms)"]
        keys = ["t_s", "t_s_req", "peak_ts", "peak_ts_req", "ttfr", "est_ppt", "e2e_ttft"]
    else:
        headers = ["model", "test", "t/s", "peak t/s", "ttfr (ms)", "est_ppt (ms)", "e2e_ttft (ms)"]
        keys = ["t_s", "peak_ts", "ttfr", "est_ppt", "e2e_ttft"]
    data = [[r["model"], r["test_name"], *(_fmt(r[k]) for k in keys)] for r in table]
    return pipe_table(headers, data, ["left"] + ["right"] * (len(headers) - 1))


ROW_METRICS = ("t_s", "t_s_req", "peak_ts", "peak_ts_req", "ttfr", "est_ppt", "e2e_ttft")
CSV_HEADERS = ["model", "test_name"] + [f"{k}_{s}" for k in ROW_METRICS for s in ("mean", "std")]


def to_csv(runs: list[DepthRun], model: str, max_concurrency: int) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_HEADERS)
    writer.writeheader()
    for r in rows(runs, model, max_concurrency):
        row: dict[str, Any] = {"model": r["model"], "test_name": r["test_name"]}
        for k in ROW_METRICS:
            m = r[k]
            row[f"{k}_mean"] = m.mean if m is not None else None
            row[f"{k}_std"] = m.std if m is not None else None
        writer.writerow(row)
    return buf.getvalue()

"""PNG plots (matplotlib, Agg backend): throughput against concurrency, TTFT against depth."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tokenmill.bench.errors import BenchError


def _save(fig: Any, path: str) -> None:
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise BenchError(f"cannot write plot {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)
    print(f"Saved {path}", file=sys.stderr)


def _mean(d: Any) -> float | None:
    return float(d["mean"]) if isinstance(d, dict) and d.get("mean") is not None else None


def _std(d: Any) -> float:
    return float(d.get("std") or 0.0) if isinstance(d, dict) else 0.0


def plot_depth(data: dict[str, Any], path: str) -> None:
    runs = [b for b in data.get("benchmarks", []) if not b.get("is_context_prefill_phase")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_shape: dict[tuple[int, int], list[tuple[int, float, float]]] = defaultdict(list)
    for b in runs:
        m = _mean(b.get("e2e_ttft"))
        if m is not None:
            by_shape[(b["prompt_size"], b["concurrency"])].append((b["context_size"], m, _std(b.get("e2e_ttft"))))
    for (pp, c), pts in sorted(by_shape.items()):
        pts.sort()
        left.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                      capsize=3, label=f"pp{pp} c{c}")
    left.set(title="TTFT against depth", xlabel="depth (context tokens)", ylabel="e2e_ttft (ms)")
    by_test: dict[tuple[str, int, int], list[tuple[int, float, float]]] = defaultdict(list)
    for b in runs:
        for kind, key, size in (("tg", "tg_throughput", b["response_size"]), ("pp", "pp_throughput", b["prompt_size"])):
            m = _mean(b.get(key))
            if m is not None:
                by_test[(kind, size, b["context_size"])].append((b["concurrency"], m, _std(b.get(key))))
    for (kind, size, depth), pts in sorted(by_test.items()):
        pts.sort()
        right.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                       linestyle="-" if kind == "tg" else "--", label=f"{kind}{size} @ d{depth}")
    right.set(title="throughput against concurrency", xlabel="concurrency", ylabel="t/s (total)")
    right.set_xticks(sorted({b["concurrency"] for b in runs}))
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"tokenmill bench depth — {data.get('model', '')}")
    _save(fig, path)


def plot_serve(results: list[dict[str, Any]], path: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    by_rate: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_rate[str(r.get("request_rate"))].append(r)
    for rate, rs in by_rate.items():
        rs = sorted(rs, key=lambda r: r.get("max_concurrency") or 10**9)
        xs = [r.get("max_concurrency") or r.get("max_concurrent_requests") for r in rs]
        left.plot(xs, [r["output_throughput"] for r in rs], marker="o", label=f"rate {rate}")
        right.plot(xs, [r.get("mean_ttft_ms", 0) for r in rs], marker="o", label=f"mean, rate {rate}")
        if "p99_ttft_ms" in rs[0]:
            right.plot(xs, [r["p99_ttft_ms"] for r in rs], marker="x", linestyle="--", label=f"p99, rate {rate}")
    left.set(title="output throughput against concurrency", xlabel="max concurrency", ylabel="output tok/s")
    ticks = sorted({int(r.get("max_concurrency") or r.get("max_concurrent_requests") or 0) for r in results})
    left.set_xticks(ticks)
    right.set_xticks(ticks)
    right.set(title="TTFT against concurrency", xlabel="max concurrency", ylabel="TTFT (ms)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"tokenmill bench serve — {results[0].get('model_id', '') if results else ''}")
    _save(fig, path)


def plot_steady(data: dict[str, Any], path: str) -> None:
    levels = sorted(data.get("levels", []), key=lambda lv: lv["concurrency"])
    xs = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("total_tps", "total t/s"), ("per_stream_tps", "per-stream t/s")):
        left.errorbar(xs, [_mean(lv.get(key)) or 0 for lv in levels], yerr=[_std(lv.get(key)) for lv in levels],
                      marker="o", capsize=3, label=label)
    right.plot(xs, [lv["ttft_ms"]["mean"] for lv in levels], marker="o", label="TTFT mean")
    right.plot(xs, [lv["itl_ms"]["mean"] for lv in levels], marker="s", label="ITL mean")
    left.set(title="steady-state decode throughput", xlabel="concurrent streams", ylabel="tok/s")
    left.set_xticks(xs)
    right.set_xticks(xs)
    right.set(title="latency against concurrency", xlabel="concurrent streams", ylabel="ms")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"tokenmill bench steady — {data.get('model', '')}")
    _save(fig, path)


def plot_refusals(data: dict[str, Any], path: str) -> None:
    levels = sorted(data.get("levels", []), key=lambda lv: lv["strength"])
    xs = [lv["strength"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(xs, [100 * (lv["refusal_rate"] or 0) for lv in levels], marker="o", label="refusal rate (%)")
    ax.plot(xs, [100 * (lv["mean_score"] or 0) for lv in levels], marker="s", linestyle="--",
            label="mean refusal score (x100)")
    ax.set(title="refusals against steering strength", xlabel=f"strength ({data.get('direction', '')})", ylabel="%",
           ylim=(0, 100))
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"tokenmill bench refusals — {data.get('model', '')}")
    _save(fig, path)

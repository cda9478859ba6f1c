"""Statistics shared by the modes: population std, percentiles, sliding-window peaks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Metric:
    """mean ± population std of a list of values, as llama-benchy's BenchmarkMetric."""

    mean: float
    std: float
    values: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "values": self.values}

    def fmt(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


def metric(values: Sequence[float], scale: float = 1.0) -> Metric | None:
    """None for no values; std is the population std (numpy's default ddof=0)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    return Metric(
        mean=float(arr.mean()) * scale,
        std=float(arr.std()) * scale,
        values=[float(v) * scale for v in arr],
    )


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in result keys: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values: Sequence[float], percentiles: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean/median/std and the requested percentiles, 0 for an empty list (as vLLM)."""
    arr = np.asarray(values if len(values) else [0.0], dtype=float)
    out = {
        "mean": float(arr.mean()) * scale,
        "median": float(np.median(arr)) * scale,
        "std": float(arr.std()) * scale,
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(arr, p)) * scale
    return out


def tokens_after_first(timestamps: Sequence[float]) -> int:
    """Tokens that arrived strictly after the first one (llama-benchy's decode count)."""
    if len(timestamps) < 2:
        return 0
    first = timestamps[0]
    return sum(1 for t in timestamps if t > first)


def peak_rate(timestamps: Sequence[float], window: float = 1.0) -> float:
    """Most tokens in any window of `window` seconds, per second.

    A burst shorter than the window is rated over its own duration, so the peak is never
    below the mean (llama-benchy's rule).
    """
    if not timestamps:
        return 0.0
    ts = sorted(timestamps)
    duration = ts[-1] - ts[0]
    if 0 < duration < window:
        return len(ts) / duration
    best = 0
    start = 0
    for end, t in enumerate(ts):
        while start < end and ts[start] <= t - window:
            start += 1
        best = max(best, end - start + 1)
    return best / window


def rate_series(timestamps: Sequence[float], window: float = 1.0) -> list[list[float]]:
    """[seconds since first token, tokens in the trailing window / window] at every token."""
    ts = sorted(timestamps)
    out: list[list[float]] = []
    start = 0
    for end, t in enumerate(ts):
        while start < end and ts[start] <= t - window:
            start += 1
        out.append([t - ts[0], (end - start + 1) / window])
    return out

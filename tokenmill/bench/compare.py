"""`bench compare A.json B.json`: one `| Test | A | B | Change |` table.

Reads tokenmill's JSON (every mode), llama-benchy's JSON and vLLM's result JSON. Change is
(B - A) / A with its sign, marked better or worse by the metric's direction, and `≈` when
|B - A| is within the combined std sqrt(std_A² + std_B²).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.depth_report import DepthRun
from tokenmill.bench.depth_report import rows as depth_rows
from tokenmill.bench.errors import ResultFormatError
from tokenmill.bench.stats import Metric
from tokenmill.bench.table import pipe_table


@dataclass
class Value:
    mean: float
    std: float
    higher_is_better: bool


def _m(d: Any) -> Metric | None:
    if isinstance(d, dict) and isinstance(d.get("mean"), (int, float)):
        return Metric(float(d["mean"]), float(d.get("std") or 0.0), list(d.get("values") or []))
    return None


DEPTH_COLUMNS = [("t_s", "", True), ("t_s_req", " t/s (req)", True), ("peak_ts", " peak t/s", True),
                 ("ttfr", " ttfr (ms)", False), ("est_ppt", " est_ppt (ms)", False),
                 ("e2e_ttft", " e2e_ttft (ms)", False)]


def _depth(data: dict[str, Any], all_metrics: bool) -> dict[str, Value]:
    runs = []
    for b in data["benchmarks"]:
        run = DepthRun(int(b.get("concurrency", 1)), int(b.get("context_size", 0)), int(b.get("prompt_size", 0)),
                       int(b.get("response_size", 0)), bool(b.get("is_context_prefill_phase", False)))
        run.metrics = {k: _m(b.get(k)) for k in ("pp_throughput", "pp_req_throughput", "tg_throughput",
                                                 "tg_req_throughput", "peak_throughput", "peak_req_throughput",
                                                 "ttfr", "est_ppt", "e2e_ttft")}
        runs.append(run)
    # always name with the (cN) suffix so files run with different concurrency sets line up
    out: dict[str, Value] = {}
    for row in depth_rows(runs, "", 2):
        name = row["test_name"].removesuffix(" (c1)")
        for key, suffix, higher in DEPTH_COLUMNS if all_metrics else DEPTH_COLUMNS[:1]:
            m = row[key]
            if m is not None:
                out[name + suffix] = Value(m.mean, m.std, higher)
    return out


VLLM_RATES = [("request_throughput", "request throughput (req/s)"), ("request_goodput", "request goodput (req/s)"),
              ("output_throughput", "output throughput (tok/s)"),
              ("total_token_throughput", "total token throughput (tok/s)"),
              ("max_output_tokens_per_s", "peak output throughput (tok/s)")]


def _vllm(data: dict[str, Any], prefix: str = "") -> dict[str, Value]:
    out: dict[str, Value] = {}
    for key, label in VLLM_RATES:
        if isinstance(data.get(key), (int, float)):
            out[prefix + label] = Value(float(data[key]), 0.0, True)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        name = metric.upper()
        stats = [k for k in data if k.endswith(f"_{metric}_ms") and not k.startswith("std_")
                 and isinstance(data[k], (int, float))]
        for key in sorted(stats, key=lambda k: (k.split("_")[0] != "mean", k.split("_")[0] != "median", k)):
            stat = key.split("_")[0]
            std = float(data.get(f"std_{metric}_ms") or 0.0) if stat == "mean" else 0.0
            out[f"{prefix}{stat} {name} (ms)"] = Value(float(data[key]), std, False)
    return out


def _serve_runs(data: dict[str, Any]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for run in data["runs"]:
        rate = run.get("request_rate", "inf")
        prefix = f"c{run.get('max_concurrency') or 'inf'}" + ("" if str(rate) == "inf" else f" @{rate}rps") + " "
        out.update(_vllm(run, prefix))
    return out


def _steady(data: dict[str, Any]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for lv in data["levels"]:
        c = f"c{lv['concurrency']}"
        for key, label, higher in (("total_tps", "total t/s", True), ("per_stream_tps", "per-stream t/s", True),
                                   ("ttft_mean_ms", "TTFT mean (ms)", False), ("itl_mean_ms", "ITL mean (ms)", False)):
            m = _m(lv.get(key))
            if m is not None:
                out[f"steady {c} {label}"] = Value(m.mean, m.std, higher)
    return out


def _tools(data: dict[str, Any]) -> dict[str, Value]:
    out = {"tools score (%)": Value(float(data["score"]), 0.0, True),
           "tools points": Value(float(data["points"]), 0.0, True),
           "tools passed": Value(float(data["passed"]), 0.0, True)}
    for s in data.get("scenarios", []):
        out[f"tools {s['name']}"] = Value(float(s["score"]), 0.0, True)
    return out


def load(path: str, all_metrics: bool = False) -> tuple[dict[str, Value], str]:
    """Tests of a result file, and a one-line description of it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ResultFormatError(f"cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise ResultFormatError(f"{path!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ResultFormatError(f"{path!r}: expected a JSON object")
    mode = data.get("mode")
    if isinstance(data.get("benchmarks"), list):
        kind = "tokenmill depth" if data.get("tool") == "tokenmill bench" else f"llama-benchy {data.get('version', '')}"
        return _depth(data, all_metrics), f"{kind} | {data.get('model', '?')}".strip()
    if mode == "steady" and isinstance(data.get("levels"), list):
        return _steady(data), f"tokenmill steady | {data.get('model', '?')}"
    if mode == "tools" and "score" in data:
        return _tools(data), f"tokenmill tools | {data.get('model', '?')}"
    if mode == "serve" and isinstance(data.get("runs"), list):
        return _serve_runs(data), "tokenmill serve sweep"
    if "request_throughput" in data or "mean_ttft_ms" in data:
        kind = "tokenmill serve" if data.get("tool") == "tokenmill bench" else "vLLM serve"
        return _vllm(data), f"{kind} | {data.get('model_id', '?')}"
    raise ResultFormatError(f"{path!r}: not a tokenmill, llama-benchy or vLLM benchmark result")


def change(a: Value, b: Value) -> tuple[str, bool]:
    """(Change cell, regressed beyond noise)."""
    diff = b.mean - a.mean
    if a.mean == 0:
        return ("=" if diff == 0 else "n/a"), False
    pct = diff / abs(a.mean) * 100
    if abs(diff) <= math.hypot(a.std, b.std):
        return f"{pct:+.2f}% ≈", False
    better = (diff > 0) == a.higher_is_better
    return f"{pct:+.2f}% {'better' if better else 'worse'}", not better


def _cell(v: Value | None) -> str:
    if v is None:
        return "—"
    return f"{v.mean:.2f} ± {v.std:.2f}" if v.std else f"{v.mean:.2f}"


def compare(a: dict[str, Value], b: dict[str, Value]) -> tuple[str, list[tuple[str, float]]]:
    """The table and the tests that got worse beyond noise, with their signed change."""
    names = list(a) + [n for n in b if n not in a]
    data: list[list[str]] = []
    worse: list[tuple[str, float]] = []
    for name in names:
        va, vb = a.get(name), b.get(name)
        cell = ""
        if va is not None and vb is not None:
            cell, regressed = change(va, vb)
            if regressed and va.mean:
                worse.append((name, (vb.mean - va.mean) / abs(va.mean) * 100))
        data.append([name, _cell(va), _cell(vb), cell])
    return pipe_table(["Test", "A", "B", "Change"], data, ["left", "right", "right", "right"]), worse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="A/B table of two saved results (tokenmill, llama-benchy or vLLM JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A.json", help="baseline result")
    p.add_argument("b", metavar="B.json", help="new result")
    p.add_argument("--all", action="store_true",
                   help="depth results: also compare t/s (req), peak t/s and the latency columns")
    p.add_argument("--fail-on-regression", type=float, default=None, metavar="PCT",
                   help="exit 1 when a test is worse by more than PCT percent beyond the combined std")
    p.set_defaults(bench_main=main)


def main(args: argparse.Namespace) -> int:
    a, desc_a = load(args.a, args.all)
    b, desc_b = load(args.b, args.all)
    print(f"A: {args.a} ({desc_a})")
    print(f"B: {args.b} ({desc_b})")
    if not set(a) & set(b):
        print("warning: the two results share no test name")
    text, worse = compare(a, b)
    print(text)
    if args.fail_on_regression is not None:
        beyond = [(n, pct) for n, pct in worse if abs(pct) > args.fail_on_regression]
        if beyond:
            print(f"Regression beyond {args.fail_on_regression:g}%: "
                  + ", ".join(f"{n} ({pct:+.2f}%)" for n, pct in beyond))
            return 1
    return 0

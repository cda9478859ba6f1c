"""`tokenmill bench steady` options, table and JSON."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from tokenmill.bench import common
from tokenmill.bench.client import Client
from tokenmill.bench.errors import BenchError
from tokenmill.bench.failures import Failures
from tokenmill.bench.stats import Metric, percentile_word, summarize
from tokenmill.bench.steady import Level, SteadyConfig, run_steady
from tokenmill.bench.table import pipe_table

DESCRIPTION = """\
Steady-state decode: at each --concurrency level, N streams send fixed-length requests
(--output-len tokens, ignore_eos) and start the next one as soon as one finishes. After
--warmup seconds, tokens arriving in a --duration-second window are counted. Reports total
and per-stream tok/s (mean ± std over --repeats windows) and TTFT and ITL distributions."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("steady", help="steady-state decode tok/s with N streams restarted as they finish",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_server_args(p)
    common.add_prompt_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                   help="streams kept busy at once, one level after another (default: 1 4 16)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    g.add_argument("--output-len", type=int, default=256, help="answer tokens per request (default: 256)")
    g.add_argument("--warmup", type=float, default=20.0, help="seconds before the window opens (default: 20)")
    g.add_argument("--duration", type=float, default=60.0, help="seconds in the measuring window (default: 60)")
    g.add_argument("--repeats", type=int, default=1, help="windows per level, for mean ± std (default: 1)")
    g.add_argument("--metric-percentiles", default="50,90,99", help="TTFT/ITL percentiles (default: %(default)s)")
    common.add_output_args(p, "draw total and per-stream tok/s and TTFT against concurrency into a PNG")
    p.set_defaults(bench_main=main)


def config_from(args: argparse.Namespace) -> SteadyConfig:
    if any(c < 1 for c in args.concurrency) or args.output_len < 1 or args.input_len < 1:
        raise BenchError("--concurrency, --input-len and --output-len must be >= 1")
    if args.duration <= 0 or args.warmup < 0 or args.repeats < 1:
        raise BenchError("--duration must be > 0, --warmup >= 0 and --repeats >= 1")
    try:
        pct = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"invalid --metric-percentiles {args.metric_percentiles!r}") from None
    return SteadyConfig(concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
                        warmup=args.warmup, duration=args.duration, repeats=args.repeats, percentiles=pct)


def _fmt(m: Metric | None) -> str:
    return m.fmt() if m is not None else ""


def table(levels: list[Level], cfg: SteadyConfig) -> str:
    pct = [percentile_word(p) for p in cfg.percentiles]
    headers = (["concurrency", "total t/s", "per-stream t/s", "TTFT mean (ms)"] + [f"TTFT p{p} (ms)" for p in pct]
               + ["ITL mean (ms)"] + [f"ITL p{p} (ms)" for p in pct] + ["requests"])
    data = []
    for lv in levels:
        m = lv.metrics()
        ttft = summarize([t for w in lv.windows for t in w.ttfts], cfg.percentiles, 1000)
        itl = summarize([t for w in lv.windows for t in w.itls], cfg.percentiles, 1000)
        data.append([f"c{lv.concurrency}", _fmt(m["total_tps"]), _fmt(m["per_stream_tps"]), _fmt(m["ttft_mean_ms"])]
                    + [f"{ttft[f'p{p}']:.2f}" for p in pct] + [_fmt(m["itl_mean_ms"])]
                    + [f"{itl[f'p{p}']:.2f}" for p in pct] + [str(sum(w.completed for w in lv.windows))])
    return pipe_table(headers, data, ["left"] + ["right"] * (len(headers) - 1))


def result_json(levels: list[Level], cfg: SteadyConfig, model: str, base_url: str, failures: Failures,
                extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "tool": "tokenmill bench", "mode": "steady", "version": common.tool_version(),
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
        "model": model, "base_url": base_url, "config": asdict(cfg),
        "levels": [lv.to_json(cfg.percentiles) for lv in levels],
        "failures": failures.to_json(), **extra,
    }


async def main(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    failures = Failures()
    async with Client(args.base_url, args.model, args.api_key, common.parse_extra_body(args.extra_body),
                      args.timeout) as client:
        setup = await common.prepare(client, args)
        levels = await run_steady(client, setup.sizer, cfg, setup.progress, failures)
    print(table(levels, cfg))
    data = result_json(levels, cfg, setup.model, client.base_url, failures,
                       {"calibration": setup.sizer.cal.to_json()})
    if args.save_result:
        common.write_json(args.save_result, data)
    if args.plot:
        from tokenmill.bench.plot import plot_steady

        plot_steady(data, args.plot)
    return failures.exit_code()

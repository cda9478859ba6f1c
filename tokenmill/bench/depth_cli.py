"""`tokenmill bench depth` options (llama-benchy's flags) and output."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from tokenmill.bench import common, depth_report
from tokenmill.bench.client import Client
from tokenmill.bench.depth import DepthConfig, DepthResult, DepthRunner
from tokenmill.bench.errors import BenchError

DESCRIPTION = """\
llama-benchy's method against any OpenAI-compatible server: prompt processing (pp) and token
generation (tg) rates at context depths and concurrency levels, reported as mean ± std
(population) over --runs runs after one discarded warm-up run. Tests are named like
'pp2048 @ d4096 (c10)'. The markdown table has llama-benchy's columns; --save-result x.json
keeps every raw value and is a superset of llama-benchy's JSON."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("depth", help="llama-benchy-compatible pp/tg sweeps over depth and concurrency",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_server_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="name sent in requests when it differs from --model (which the table shows)")
    common.add_prompt_args(p)
    g = p.add_argument_group("sweep")
    g.add_argument("--pp", type=int, nargs="+", default=[2048], help="prompt sizes in tokens (default: 2048)")
    g.add_argument("--tg", type=int, nargs="+", default=[32], help="tokens to generate (default: 32)")
    g.add_argument("--depth", type=int, nargs="+", default=[0],
                   help="context tokens sent in a system message before the prompt (default: 0)")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1],
                   help="requests started together per run; totals use the span of the batch (default: 1)")
    g.add_argument("--runs", type=int, default=3, help="measured runs per test (default: 3)")
    g.add_argument("--latency-mode", choices=["api", "generation", "none"], default="api",
                   help="latency subtracted from ttfr to estimate prompt processing time: 'api' (GET "
                        "/models), 'generation' (first byte of a 1-token answer) or 'none' (default: api)")
    g.add_argument("--no-warmup", action="store_true", help="do not run (and discard) a warm-up run per test")
    g.add_argument("--skip-coherence", action="store_true",
                   help="skip the check that the model answers 'Paris' to a capital-of-France question")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="at depth > 0, first send the context alone (reported as ctx_pp/ctx_tg), then the "
                        "same context with the prompt, to measure prefix-cache hits")
    g.add_argument("--no-cache", action="store_true", help="also send cache_prompt=false (llama.cpp)")
    g.add_argument("--exact-tg", action="store_true",
                   help="send min_tokens=tg and ignore_eos=true so every answer has exactly tg tokens")
    g.add_argument("--exit-on-first-fail", action="store_true", help="stop at the first failed request")
    o = p.add_argument_group("report")
    o.add_argument("--format", choices=["md", "json", "csv"], default="md", help="what to print (default: md)")
    o.add_argument("--save-total-throughput-timeseries", action="store_true",
                   help="keep the 1 s-window total throughput series of every run in the JSON")
    o.add_argument("--save-all-throughput-timeseries", action="store_true",
                   help="keep the 1 s-window throughput series of every request in the JSON")
    common.add_output_args(p, "draw TTFT against depth and t/s against concurrency into a PNG")
    p.set_defaults(bench_main=main)


def config_from(args: argparse.Namespace) -> DepthConfig:
    for name in ("pp", "tg", "depth", "concurrency"):
        values = getattr(args, name)
        low = 0 if name == "depth" else 1
        if any(v < low for v in values):
            raise BenchError(f"--{name} values must be >= {low}")
    if args.runs < 1:
        raise BenchError("--runs must be >= 1")
    return DepthConfig(
        pp=args.pp, tg=args.tg, depth=args.depth, concurrency=args.concurrency, runs=args.runs,
        latency_mode=args.latency_mode, no_warmup=args.no_warmup, skip_coherence=args.skip_coherence,
        enable_prefix_caching=args.enable_prefix_caching, no_cache=args.no_cache, exact_tg=args.exact_tg,
        exit_on_first_fail=args.exit_on_first_fail,
        save_total_throughput_timeseries=args.save_total_throughput_timeseries,
        save_all_throughput_timeseries=args.save_all_throughput_timeseries,
    )


def result_json(result: DepthResult, base_url: str, extra: dict[str, Any]) -> dict[str, Any]:
    """llama-benchy's report keys first, then tokenmill's additions."""
    return {
        "version": common.tool_version(),
        "timestamp": result.timestamp,
        "latency_mode": result.config.latency_mode,
        "latency_ms": result.latency * 1000,
        "model": result.model,
        "prefix_caching_enabled": result.config.enable_prefix_caching,
        "max_concurrency": result.max_concurrency,
        "benchmarks": [run.to_json() for run in result.runs],
        "tool": "tokenmill bench",
        "mode": "depth",
        "base_url": base_url,
        "config": asdict(result.config),
        "failures": result.failures.to_json(),
        **extra,
    }


def render(result: DepthResult, fmt: str, data: dict[str, Any]) -> str:
    if fmt == "json":
        import json

        return json.dumps(data, indent=2)
    if fmt == "csv":
        return depth_report.to_csv(result.runs, result.model, result.max_concurrency)
    return depth_report.markdown(result.runs, result.model, result.max_concurrency)


async def main(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    api_name = args.served_model_name or args.model
    async with Client(args.base_url, api_name, args.api_key, common.parse_extra_body(args.extra_body),
                      args.timeout) as client:
        setup = await common.prepare(client, args)
        result = await DepthRunner(client, setup.sizer, cfg, setup.progress).run(args.model or setup.model)
    data = result_json(result, client.base_url, {"calibration": setup.sizer.cal.to_json()})
    print(render(result, args.format, data))
    print(f"\n{common.tool_version()} bench depth")
    print(f"date: {result.timestamp} | latency mode: {cfg.latency_mode}")
    if args.save_result:
        ext = args.save_result.rsplit(".", 1)[-1].lower()
        fmt = ext if ext in ("md", "csv") else "json"
        if fmt == "json":
            common.write_json(args.save_result, data)
        else:
            common.write_text(args.save_result, render(result, fmt, data) + "\n")
    if args.plot:
        from tokenmill.bench.plot import plot_depth

        plot_depth(data, args.plot)
    return result.failures.exit_code()

"""`tokenmill bench serve` options (vLLM's flag names) and vLLM's result block and JSON."""

from __future__ import annotations

import argparse
import math
from datetime import datetime
from typing import Any

from tokenmill.bench import common
from tokenmill.bench.client import Client
from tokenmill.bench.errors import BenchError
from tokenmill.bench.failures import Failures
from tokenmill.bench.serve import METRIC_NAMES, ServeConfig, run_serve
from tokenmill.bench.stats import percentile_word
from tokenmill.bench.table import pipe_table

HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}

DESCRIPTION = """\
vLLM's serving benchmark against any OpenAI-compatible server: --num-prompts streaming chat
requests of --input-len prompt tokens (fresh corpus slices) and --output-len answer tokens,
arriving at --request-rate (Poisson, or gamma with --burstiness; inf sends all at once) with
at most --max-concurrency in flight. Reports TTFT, TPOT, ITL and E2E latency (mean, median,
std, percentiles), request/output/total throughput and goodput under --goodput SLOs. The JSON
uses vLLM's result keys. Several --max-concurrency or --request-rate values run a sweep."""


def _goodput(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        for pair in item.split():
            try:
                name, value = pair.split(":")
                out[name] = float(value)
            except ValueError:
                raise BenchError(f"invalid --goodput {pair!r}: use KEY:MS, e.g. ttft:500 tpot:50") from None
            if name not in ("ttft", "tpot", "e2el") or out[name] < 0:
                raise BenchError(f"invalid --goodput {pair!r}: KEY is ttft, tpot or e2el and MS >= 0")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="vLLM-style serving load: TTFT/TPOT/ITL/E2E, throughput, goodput",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_server_args(p)
    common.add_prompt_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=200, help="requests to send (default: 200)")
    g.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default: 1024)")
    g.add_argument("--output-len", type=int, default=128, help="answer tokens per request (default: 128)")
    g.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests per second; inf sends all at once (default: inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 is Poisson, <1 burstier, >1 more even")
    g.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="most requests in flight at once (default: unlimited)")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput in ms, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles for (default: %(default)s)")
    g.add_argument("--metric-percentiles", default="90,99", help="percentiles to report (default: %(default)s)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers stop at EOS (by default ignore_eos and min_tokens fix their length)")
    g.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests first (default: 1)")
    g.add_argument("--label", default=None, help="label stored in the result JSON")
    common.add_output_args(p, "draw output throughput and TTFT against concurrency into a PNG")
    p.set_defaults(bench_main=main)


def config_from(args: argparse.Namespace) -> ServeConfig:
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRIC_NAMES]
    if bad:
        raise BenchError(f"unknown --percentile-metrics {bad}; choose from {list(METRIC_NAMES)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise BenchError(f"invalid --metric-percentiles {args.metric_percentiles!r}") from None
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be >= 1")
    return ServeConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                       burstiness=args.burstiness, goodput=_goodput(args.goodput), percentile_metrics=metrics,
                       percentiles=percentiles, ignore_eos=args.ignore_eos, num_warmups=args.num_warmups,
                       seed=args.seed)


def print_block(r: dict[str, Any], cfg: ServeConfig) -> None:
    """vLLM's '=== Serving Benchmark Result ===' block."""
    def line(label: str, value: Any, fmt: str = "") -> None:
        print(("{:<40} {:<10" + fmt + "}").format(label, value))

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", r["completed"])
    line("Failed requests:", r["failed"])
    if cfg.max_concurrency is not None:
        line("Maximum request concurrency:", cfg.max_concurrency)
    if not math.isinf(cfg.request_rate):
        line("Request rate configured (RPS):", cfg.request_rate, ".2f")
    line("Benchmark duration (s):", r["duration"], ".2f")
    line("Total input tokens:", r["total_input_tokens"])
    line("Total generated tokens:", r["total_output_tokens"])
    line("Request throughput (req/s):", r["request_throughput"], ".2f")
    if r["request_goodput"] is not None:
        line("Request goodput (req/s):", r["request_goodput"], ".2f")
    line("Output token throughput (tok/s):", r["output_throughput"], ".2f")
    line("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"], ".2f")
    line("Peak concurrent requests:", r["max_concurrent_requests"], ".2f")
    line("Total Token throughput (tok/s):", r["total_token_throughput"], ".2f")
    for name in cfg.percentile_metrics:
        label = METRIC_NAMES[name]
        print("{s:{c}^{n}}".format(s=HEADERS[name], n=50, c="-"))
        line(f"Mean {label} (ms):", r[f"mean_{name}_ms"], ".2f")
        line(f"Median {label} (ms):", r[f"median_{name}_ms"], ".2f")
        for p in cfg.percentiles:
            w = percentile_word(p)
            line(f"P{w} {label} (ms):", r[f"p{w}_{name}_ms"], ".2f")
    print("=" * 50)


def sweep_table(results: list[dict[str, Any]]) -> str:
    headers = ["max concurrency", "request rate", "req/s", "output tok/s", "mean TTFT (ms)",
               "p99 TTFT (ms)", "mean TPOT (ms)", "mean ITL (ms)", "failed"]
    data = [[str(r["max_concurrency"]), str(r["request_rate"]), f"{r['request_throughput']:.2f}",
             f"{r['output_throughput']:.2f}", f"{r.get('mean_ttft_ms', 0):.2f}", f"{r.get('p99_ttft_ms', 0):.2f}",
             f"{r.get('mean_tpot_ms', 0):.2f}", f"{r.get('mean_itl_ms', 0):.2f}", str(r["failed"])] for r in results]
    return pipe_table(headers, data, ["right"] * len(headers))


async def main(args: argparse.Namespace) -> int:
    base = config_from(args)
    results: list[dict[str, Any]] = []
    failures = Failures()
    async with Client(args.base_url, args.model, args.api_key, common.parse_extra_body(args.extra_body),
                      args.timeout) as client:
        setup = await common.prepare(client, args)
        for rate in args.request_rate:
            for conc in args.max_concurrency:
                if conc is not None and conc < 1:
                    raise BenchError("--max-concurrency must be >= 1")
                cfg = ServeConfig(**{**base.__dict__, "request_rate": rate, "max_concurrency": conc})
                r = await run_serve(client, setup.sizer, cfg, setup.progress, failures)
                print_block(r, cfg)
                header = {
                    "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai-chat",
                    "backend": "openai-chat", "label": args.label, "model_id": setup.model,
                    "tokenizer_id": args.tokenizer or setup.sizer.corpus.tokenizer.name,
                    "num_prompts": cfg.num_prompts, "request_rate": rate if not math.isinf(rate) else "inf",
                    "burstiness": cfg.burstiness, "max_concurrency": conc,
                }
                extra = {"tool": "tokenmill bench", "mode": "serve", "version": common.tool_version(),
                         "base_url": client.base_url, "input_len": cfg.input_len, "output_len": cfg.output_len,
                         "goodput_slo_ms": cfg.goodput, "calibration": setup.sizer.cal.to_json()}
                results.append({**header, **r, **extra})
    if len(results) > 1:
        print(sweep_table(results))
    data = results[0] if len(results) == 1 else {
        "tool": "tokenmill bench", "mode": "serve", "version": common.tool_version(), "runs": results}
    if args.save_result:
        common.write_json(args.save_result, data)
    if args.plot:
        from tokenmill.bench.plot import plot_serve

        plot_serve(results, args.plot)
    return failures.exit_code()

"""`tokenmill bench {depth,serve,steady,compare,tools,refusals}`.

`register(subparsers)` adds the `bench` command to tokenmill's top-level parser and sets
`func` (and `handler`, the name tokenmill/cli.py uses) on the parsed namespace:
`sys.exit(args.func(args))` runs it. `main(argv)` runs the
same parser stand-alone (`python -m tokenmill.bench ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.bench.errors import BenchError

DESCRIPTION = """\
Benchmark any OpenAI-compatible server (tokenmill, vLLM, SGLang, llama.cpp) over HTTP.

  depth    llama-benchy's pp/tg sweeps over context depth and concurrency
  serve    vLLM's serving metrics (TTFT, TPOT, ITL, E2E, throughput, goodput) under load
  steady   steady-state decode with N streams restarted as they finish
  compare  A/B table of two saved results (ours, llama-benchy's or vLLM's JSON)
  tools    tool-calling evaluation scored 2/1/0 per scenario
  refusals refusal rate and refusal score per steering strength

Exit status: 0 success, 1 some requests failed or a regression was found, 2 the run could
not be done (server unreachable, bad arguments, unreadable file), 130 interrupted."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.bench import compare, depth_cli, refusals_cli, serve_cli, steady_cli, tools_cli

    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server over HTTP",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE")
    modes.required = True
    for module in (depth_cli, serve_cli, steady_cli, compare, tools_cli, refusals_cli):
        module.add_parser(modes)
    p.set_defaults(func=run, handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen mode; every expected failure ends in one line on stderr."""
    entry: Callable[[argparse.Namespace], Any] = args.bench_main
    try:
        out = entry(args)
        if asyncio.iscoroutine(out):
            out = asyncio.run(out)
        return int(out or 0)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

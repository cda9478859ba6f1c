"""`tokenmill bench tools`: run the tool-calling scenarios against any endpoint."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tokenmill.bench import common
from tokenmill.bench.client import Client
from tokenmill.bench.errors import BenchError
from tokenmill.bench.progress import Progress
from tokenmill.bench.table import pipe_table
from tokenmill.bench.tool_scenarios import SCENARIOS, Answer, Scenario

DESCRIPTION = """\
Tool-calling evaluation: one call, parallel calls, choosing among tools, answering without a
tool, number/enum argument types, multi-turn with a tool result, declining when no tool fits,
and tool_choice naming a function. Each scenario scores 2 (right), 1 (partly) or 0; the
report gives score (% of the maximum), points, scenarios passed and wall time. Requests are
streamed (delta.tool_calls fragments are assembled) unless --no-stream."""


@dataclass
class Outcome:
    scenario: Scenario
    score: int
    detail: str
    seconds: float
    answer: Answer | None
    error: str | None = None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tools", help="tool-calling evaluation scored 2/1/0 per scenario",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_server_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--no-stream", dest="stream", action="store_false", help="ask for whole answers")
    g.add_argument("--max-tokens", type=int, default=512, help="answer budget per scenario (default: 512)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    g.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help=f"run only these scenarios: {', '.join(s.name for s in SCENARIOS)}")
    g.add_argument("--save-result", default=None, metavar="PATH", help="write the scores and answers as JSON")
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar")
    p.set_defaults(bench_main=main)


async def run_scenario(client: Client, s: Scenario, stream: bool, max_tokens: int, temperature: float) -> Outcome:
    body: dict[str, Any] = {"messages": s.messages, "tools": s.tools, "tool_choice": s.tool_choice,
                            "max_tokens": max_tokens, "temperature": temperature, **s.extra}
    start = time.perf_counter()
    if stream:
        rec = await client.stream_chat(body)
        seconds = time.perf_counter() - start
        if not rec.ok:
            return Outcome(s, 0, f"request failed: {rec.error}", seconds, None, rec.error)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in rec.calls()]
        answer = Answer(rec.text, calls, rec.finish_reason)
    else:
        try:
            resp = await client.chat({**body, "stream": False})
        except BenchError as exc:
            return Outcome(s, 0, f"request failed: {exc}", time.perf_counter() - start, None, str(exc))
        seconds = time.perf_counter() - start
        choice = (resp.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        calls = [((c.get("function") or {}).get("name", ""), (c.get("function") or {}).get("arguments") or "")
                 for c in msg.get("tool_calls") or []]
        answer = Answer(msg.get("content") or "", calls, choice.get("finish_reason"))
    score, detail = s.score(answer)
    if answer.calls and answer.finish_reason not in (None, "tool_calls") and score == 2:
        score, detail = 1, f"{detail}; finish_reason {answer.finish_reason!r} instead of 'tool_calls'"
    return Outcome(s, score, detail, seconds, answer)


def table(outcomes: list[Outcome]) -> str:
    data = [[o.scenario.name, o.scenario.what, str(o.score), o.detail[:70], f"{o.seconds:.2f}"] for o in outcomes]
    return pipe_table(["scenario", "checks", "score", "detail", "time (s)"], data,
                      ["left", "left", "right", "left", "right"])


def result_json(outcomes: list[Outcome], model: str, base_url: str, wall: float, stream: bool) -> dict[str, Any]:
    points = sum(o.score for o in outcomes)
    top = 2 * len(outcomes)
    return {
        "tool": "tokenmill bench", "mode": "tools", "version": common.tool_version(),
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
        "model": model, "base_url": base_url, "stream": stream,
        "score": 100.0 * points / top if top else 0.0, "points": points, "max_points": top,
        "passed": sum(1 for o in outcomes if o.score == 2), "scenarios_run": len(outcomes), "wall_s": wall,
        "failed_requests": sum(1 for o in outcomes if o.error),
        "scenarios": [{"name": o.scenario.name, "score": o.score, "detail": o.detail, "seconds": o.seconds,
                       "text": o.answer.text if o.answer else None,
                       "tool_calls": [{"name": n, "arguments": a} for n, a in (o.answer.calls if o.answer else [])],
                       "error": o.error} for o in outcomes],
    }


async def main(args: argparse.Namespace) -> int:
    chosen = SCENARIOS
    if args.only:
        unknown = set(args.only) - {s.name for s in SCENARIOS}
        if unknown:
            raise BenchError(f"unknown scenario(s) {sorted(unknown)}; choose from {[s.name for s in SCENARIOS]}")
        chosen = [s for s in SCENARIOS if s.name in args.only]
    progress = Progress(args.progress)
    async with Client(args.base_url, args.model, args.api_key, common.parse_extra_body(args.extra_body),
                      args.timeout) as client:
        model = await client.resolve_model()
        progress.start(len(chosen), "tools", unit="scenario")
        start = time.perf_counter()
        outcomes = []
        for s in chosen:
            progress.describe(s.name)
            outcomes.append(await run_scenario(client, s, args.stream, args.max_tokens, args.temperature))
            progress.update()
        wall = time.perf_counter() - start
        progress.close()
    data = result_json(outcomes, model, client.base_url, wall, args.stream)
    print(table(outcomes))
    print(f"\nscore {data['score']:.1f}% | points {data['points']}/{data['max_points']} | "
          f"passed {data['passed']}/{len(outcomes)} | wall {wall:.2f} s | model {model}")
    if args.save_result:
        common.write_json(args.save_result, data)
    if data["failed_requests"]:
        print(f"{data['failed_requests']} of {len(outcomes)} requests failed:")
        for o in outcomes:
            if o.error:
                print(f"  {o.scenario.name}: {o.error}")
        return 1
    return 0

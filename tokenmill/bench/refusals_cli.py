"""`tokenmill bench refusals`: refusal rate and mean refusal score per steering strength."""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tokenmill.bench import common
from tokenmill.bench.client import Client
from tokenmill.bench.errors import BenchError
from tokenmill.bench.progress import Progress
from tokenmill.bench.table import pipe_table

DESCRIPTION = """\
Send every prompt (one user message each) at each steering strength and judge the answers:
refusal rate and mean refusal score per strength. The judgement is the server's own `refusal`
object when it returns one (tokenmill with --steering or --refusal-detector on); otherwise the
phrase detector runs here (signal "phrases (client)"), so any OpenAI-compatible server can be
measured. Strength 0 is sent with no dial (a server without --steering answers it too); others
as "steering": {DIRECTION: s} (--via field) or cache_salt "DIRECTION:s" (--via cache_salt)."""


@dataclass
class Judged:
    prompt: str
    text: str = ""
    refused: bool = False
    score: float = 0.0
    signal: str = ""
    tokens: int = 0
    error: str | None = None


@dataclass
class Level:
    strength: float
    answers: list[Judged] = field(default_factory=list)

    @property
    def ok(self) -> list[Judged]:
        return [a for a in self.answers if a.error is None]

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        signals = sorted({a.signal for a in ok})
        return {"strength": self.strength, "prompts": len(self.answers), "answered": len(ok),
                "refused": sum(a.refused for a in ok), "refusal_rate": sum(a.refused for a in ok) / len(ok) if ok else None,
                "mean_score": sum(a.score for a in ok) / len(ok) if ok else None, "signal": ", ".join(signals),
                "failed": len(self.answers) - len(ok),
                "mean_completion_tokens": sum(a.tokens for a in ok) / len(ok) if ok else None}


def _strengths(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--strengths takes numbers separated by commas, not {text!r}") from None
    if not values or any(not 0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError("--strengths must be finite, non-negative numbers")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("refusals", help="refusal rate and refusal score per steering strength",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_server_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts, one per line (# comments skipped); default: the shipped held-out refuse set")
    g.add_argument("--strengths", type=_strengths, default=[0.0, 0.5, 1.0], metavar="S1,S2,...",
                   help="steering strengths to measure (default: 0,0.5,1)")
    g.add_argument("--direction", default="refusal", help="the steered direction's name (default: refusal)")
    g.add_argument("--via", choices=["field", "cache_salt"], default="field",
                   help='how a strength is sent: "steering": {...} or cache_salt "NAME:s" (default: field)')
    g.add_argument("--max-tokens", type=int, default=32, help="answer budget per prompt (default: 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    common.add_output_args(p, "write a PNG of refusal rate and mean score against strength")
    p.set_defaults(bench_main=main)


def _dial(strength: float, direction: str, via: str) -> dict[str, Any]:
    if strength == 0:
        return {}
    if via == "cache_salt":
        return {"cache_salt": f"{direction}:{strength:g}"}
    return {"steering": {direction: strength}}


async def _ask(client: Client, prompt: str, strength: float, args: argparse.Namespace) -> Judged:
    from tokenmill.steering.detector import RefusalDetector

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": False, **_dial(strength, args.direction, args.via)}
    try:
        resp = await client.chat(body)
    except BenchError as exc:
        return Judged(prompt, error=str(exc))
    choice = (resp.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    tokens = int((resp.get("usage") or {}).get("completion_tokens") or 0)
    verdict = choice.get("refusal")
    if isinstance(verdict, dict) and {"score", "refused"} <= set(verdict):
        return Judged(prompt, text, bool(verdict["refused"]), float(verdict["score"]), str(verdict.get("signal", "")),
                      tokens)
    local = RefusalDetector().judge(text)
    return Judged(prompt, text, local.refused, local.score, "phrases (client)", tokens)


def table(levels: list[Level]) -> str:
    rows = []
    for level in levels:
        s = level.summary()
        rate = "-" if s["refusal_rate"] is None else f"{100 * s['refusal_rate']:.1f}%"
        score = "-" if s["mean_score"] is None else f"{s['mean_score']:.3f}"
        rows.append([f"{level.strength:g}", str(s["answered"]), str(s["refused"]), rate, score, s["signal"] or "-",
                     str(s["failed"])])
    return pipe_table(["strength", "answered", "refused", "refusal rate", "mean score", "signal", "failed"], rows,
                      ["right", "right", "right", "right", "right", "left", "right"])


def result_json(levels: list[Level], model: str, base_url: str, args: argparse.Namespace, wall: float) -> dict[str, Any]:
    return {
        "tool": "tokenmill bench", "mode": "refusals", "version": common.tool_version(),
        "timestamp": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"), "model": model, "base_url": base_url,
        "direction": args.direction, "via": args.via, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "prompts_file": args.prompts or "shipped refuse_heldout.txt", "wall_s": wall,
        "levels": [{**level.summary(), "responses": [vars(a) for a in level.answers]} for level in levels],
    }


async def main(args: argparse.Namespace) -> int:
    from tokenmill.errors import ConfigError
    from tokenmill.steering.prompts import read_prompts

    if args.max_tokens < 1 or args.concurrency < 1:
        raise BenchError("--max-tokens and --concurrency must be positive")
    try:
        prompts = read_prompts(args.prompts, "refuse_heldout")
    except ConfigError as exc:
        raise BenchError(str(exc)) from None
    progress = Progress(args.progress)
    levels = [Level(s) for s in args.strengths]
    gate = asyncio.Semaphore(args.concurrency)
    async with Client(args.base_url, args.model, args.api_key, common.parse_extra_body(args.extra_body),
                      args.timeout) as client:
        model = await client.resolve_model()
        progress.start(len(prompts) * len(levels), "refusals")
        start = time.perf_counter()

        async def one(level: Level, index: int) -> None:
            async with gate:
                level.answers[index] = await _ask(client, prompts[index], level.strength, args)
                progress.update()

        for level in levels:
            level.answers = [Judged(p) for p in prompts]
        await asyncio.gather(*(one(level, i) for level in levels for i in range(len(prompts))))
        wall = time.perf_counter() - start
        progress.close()
    data = result_json(levels, model, client.base_url, args, wall)
    print(table(levels))
    print(f"\n{len(prompts)} prompts x {len(levels)} strengths | wall {wall:.2f} s | model {model}")
    if args.save_result:
        common.write_json(args.save_result, data)
    if args.plot:
        from tokenmill.bench.plot import plot_refusals

        plot_refusals(data, args.plot)
    failed = [a for level in levels for a in level.answers if a.error]
    if failed:
        print(f"{len(failed)} requests failed; the first: {failed[0].error}")
        return 1
    return 0

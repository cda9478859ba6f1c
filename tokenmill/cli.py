"""`tokenmill` command line: serve | generate | bench | draft-vocab | quantize | steer."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys

if __name__ == "__main__":  # `python -m tokenmill.cli`: the imports below are start-up too (see main)
    gc.disable()

from tokenmill.bench.cli import register as register_bench
from tokenmill.config import EngineConfig, add_engine_args
from tokenmill.errors import TokenmillError
from tokenmill.quantize.cli import register as register_quantize
from tokenmill.server.serve import register as register_serve
from tokenmill.speculative.cli import register as register_draft_vocab
from tokenmill.steering.cli import register as register_steer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="LLM inference engine and OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_serve(commands)
    _add_generate(commands)
    register_bench(commands)
    register_draft_vocab(commands)
    register_quantize(commands)
    register_steer(commands)
    return parser


def _add_generate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "generate", help="generate text for prompts offline",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate completions for one or more prompts and print them.",
    )
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt; repeat the flag for several prompts")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--steer", action="append", default=[], metavar="NAME=S",
                   help="steer every prompt along a direction of the --steering file, e.g. refusal=1 (repeatable)")
    add_engine_args(p)
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(config=EngineConfig.from_cli_args(args))
    prompts: list[str | list[int]] = list(args.prompt)
    if args.chat:
        if llm.tokenizer is None or not llm.tokenizer.chat_template:
            raise TokenmillError("--chat needs a model whose tokenizer has a chat template")
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in args.prompt
        ]
        prompts = [list(llm.tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
    )
    steering = {}
    for item in args.steer:
        name, _, value = item.partition("=")
        try:
            steering[name] = float(value)
        except ValueError:
            raise TokenmillError(f"--steer takes NAME=STRENGTH (e.g. refusal=1), not {item!r}") from None
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1, steering=steering or None)
    for prompt, out in zip(args.prompt, outputs):
        answer = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": answer.text, "token_ids": answer.token_ids,
                              "finish_reason": answer.finish_reason}))
        else:
            print(f"--- {prompt!r} ({answer.finish_reason})\n{answer.text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # Start-up (imports, tokenizer, weights) makes millions of objects that live as long as the
    # process: cyclic collections while it runs only cost time (1.1-1.5 s of `serve` on the
    # default model). A command whose start-up ends by freezing them (`serve`: build_server's
    # collect and freeze) turns collection back on itself; the others get it back here.
    gc.disable()
    try:
        args = build_parser().parse_args(argv)
    finally:
        gc.enable()
    if getattr(args, "gc_off_until_ready", False):
        gc.disable()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except TokenmillError as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

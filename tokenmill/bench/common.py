"""Options every mode shares, and the set-up every load-generating mode does."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from tokenmill.bench.client import Client
from tokenmill.bench.corpus import Corpus, load_tokenizer, read_corpus_text
from tokenmill.bench.errors import BenchError
from tokenmill.bench.progress import Progress
from tokenmill.bench.sizing import Calibration, PromptSizer, calibrate


def tool_version() -> str:
    try:
        return f"tokenmill {metadata.version('tokenmill')}"
    except metadata.PackageNotFoundError:
        return "tokenmill (source tree)"


def parse_extra_body(items: list[str]) -> dict[str, Any]:
    """llama-benchy's --extra-body: key=value or key:value, comma-separated or repeated,
    values parsed as JSON when they are JSON; a whole JSON object is accepted too."""
    extra: dict[str, Any] = {}
    for item in items:
        if item.strip().startswith("{"):
            try:
                extra.update(json.loads(item))
            except ValueError:
                raise BenchError(f"--extra-body {item!r} is not valid JSON") from None
            continue
        for entry in (e.strip() for e in item.split(",") if e.strip()):
            sep = "=" if "=" in entry else ":" if ":" in entry else None
            if sep is None:
                raise BenchError(f"invalid --extra-body entry {entry!r}: use key=value or key:value")
            key, raw = (s.strip() for s in entry.split(sep, 1))
            if not key:
                raise BenchError(f"invalid --extra-body entry {entry!r}: empty key")
            try:
                extra[key] = json.loads(raw)
            except ValueError:
                extra[key] = raw
    return extra


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="OpenAI-compatible endpoint; '/v1' is added when the URL has no path "
                        "(default: %(default)s)")
    g.add_argument("--api-key", default="EMPTY", help="bearer token sent with every request")
    g.add_argument("--model", default=None,
                   help="model name sent in requests (default: the first model GET /v1/models lists)")
    g.add_argument("--extra-body", action="append", default=[], metavar="KEY=VALUE",
                   help="extra JSON fields merged into every chat request; key=value or key:value, "
                        "comma-separated or repeated, or one JSON object")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds before one request is abandoned")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts and token counting")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer used to cut prompts and, as a last resort, to count tokens: "
                        "a tokenizer.json, a folder holding one, a .gguf file, or a cached HF model name "
                        "(default: a built-in approximation calibrated against the server's usage)")
    g.add_argument("--corpus", default=None, metavar="PATH",
                   help="UTF-8 text to cut prompts from (default: the shipped public-domain corpus, "
                        "Newton's Opticks)")
    g.add_argument("--no-adapt-prompt", dest="adapt_prompt", action="store_false",
                   help="do not calibrate prompt sizes against the server's usage.prompt_tokens")
    g.add_argument("--seed", type=int, default=None, help="seed for corpus offsets and arrivals")


def add_output_args(p: argparse.ArgumentParser, plot_help: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--save-result", default=None, metavar="PATH",
                   help="write the result with every raw value (.json; depth also writes .csv/.md)")
    g.add_argument("--plot", default=None, metavar="PNG", help=plot_help)
    g.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar (by default one is drawn on a terminal)")


@dataclass
class Setup:
    client: Client
    sizer: PromptSizer
    model: str
    progress: Progress


async def prepare(client: Client, args: argparse.Namespace) -> Setup:
    """Check the server answers, pick the model, load the corpus and calibrate sizes."""
    progress = Progress(args.progress)
    model = await client.resolve_model()
    tokenizer = load_tokenizer(args.tokenizer)
    text = read_corpus_text(args.corpus)
    corpus = Corpus(tokenizer, text, seed=args.seed)
    if args.adapt_prompt:
        cal = await calibrate(client, corpus)
        if cal.source == "none":
            progress.write("Note: the server returns no usage block; prompt sizes use the local tokenizer.")
    else:
        cal = Calibration()
    progress.write(f"Model: {model} at {client.base_url} | corpus: {len(corpus)} {tokenizer.name} tokens "
                   f"| calibration: {cal.slope:.3f} server tokens per local token")
    return Setup(client, PromptSizer(corpus, cal), model, progress)


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings, as vLLM writes request_rate 'inf'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    write_text(path, json.dumps(_clean(data), indent=2) + "\n")


def write_text(path: str, text: str) -> None:
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise BenchError(f"cannot write {path!r}: {exc.strerror}") from None
    print(f"Saved {path}", file=sys.stderr)

"""`tokenmill steer build`: write a steering directory for `tokenmill serve --steering DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = """\
Build a refusal direction from the model's own activations: the difference of the mean residual
streams (float64) over prompts it refuses and prompts it answers, at each layer's input over the
chat template's post-instruction positions; the layer and position picked by a held-out score (the
refusal rate at strength 1 on validation refuse prompts, with the comply set's next-token KL
bounded). Writes DIR/directions.safetensors and DIR/steering.json. Without --refuse / --comply it
uses the prompt sets shipped for the default model (SmolLM2-135M-Instruct)."""


def _layers(text: str) -> tuple[int, ...]:
    try:
        if ":" in text:
            start, stop = (int(x) for x in text.split(":"))
            return tuple(range(start, stop))
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes A:B (layers A..B-1) or a comma list, not {text!r}") from None


def register(commands: argparse._SubParsersAction) -> None:
    steer = commands.add_parser("steer", help="build refusal-steering directions",
                                description="Refusal steering: `tokenmill steer build`.")
    actions = steer.add_subparsers(dest="steer_action", metavar="ACTION", required=True)
    p = actions.add_parser("build", help="compute a refusal direction and write a steering directory",
                           description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--refuse", type=Path, default=None, metavar="R.txt",
                   help="prompts the model refuses, one per line (default: the shipped set)")
    p.add_argument("--comply", type=Path, default=None, metavar="C.txt",
                   help="prompts the model answers, one per line (default: the shipped set)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the steering directory to write")
    p.add_argument("--name", default="refusal", help="the direction's name (what requests set: cache_salt NAME:x)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="model dtype (default: auto = bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--val-fraction", type=float, default=0.25,
                   help="share of each set held out to pick the layer (default: 0.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split (default: 0)")
    p.add_argument("--score-tokens", type=int, default=16,
                   help="tokens generated per answer to measure refusal rates (default: 16)")
    p.add_argument("--detector-tokens", type=int, default=4,
                   help="first generated rows whose projection the detector averages (default: 4)")
    p.add_argument("--layers", type=_layers, default=None, metavar="A:B|L1,L2",
                   help="candidate layers (default: 1 to 80%% of the depth)")
    p.add_argument("--shortlist", type=int, default=6,
                   help="candidates within the KL bound (the largest drop of the refusals' openings first) whose "
                        "refusal rate is measured by generating (default: 6)")
    p.add_argument("--max-comply-kl", type=float, default=0.1,
                   help="largest mean next-token KL over the comply answers' first positions a chosen direction may "
                        "cause at strength 1 (default: 0.1)")
    p.add_argument("--no-filter", dest="filter", action="store_false",
                   help="use every train prompt, not only those the model refused / answered")
    p.set_defaults(handler=run_build)


def run_build(args: argparse.Namespace) -> int:
    from tokenmill.steering.build import BuildOptions, build, summary

    if not 0 < args.val_fraction < 1:
        raise SystemExit("tokenmill steer build: --val-fraction must be in (0, 1)")
    if args.score_tokens < 1 or args.detector_tokens < 1 or args.shortlist < 1:
        raise SystemExit("tokenmill steer build: --score-tokens, --detector-tokens and --shortlist must be positive")
    options = BuildOptions(out=args.out, model=args.model, refuse=args.refuse, comply=args.comply, name=args.name,
                           device=args.device, dtype=args.dtype, val_fraction=args.val_fraction, seed=args.seed,
                           score_tokens=args.score_tokens, detector_tokens=args.detector_tokens, layers=args.layers,
                           shortlist=args.shortlist, max_comply_kl=args.max_comply_kl, filter=args.filter)
    report = build(options, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"out": str(args.out), **summary(report)}, indent=2))
    return 0

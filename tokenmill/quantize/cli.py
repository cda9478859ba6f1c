"""`tokenmill quantize MODEL --format F --out DIR`: a checkpoint tokenmill (and ModelOpt-format
readers) load quantized. `register(subparsers)` adds the command and sets `handler`."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Quantize a model's linear layers (attention and MLP projections, routed experts) and write a
checkpoint that `tokenmill serve --model DIR` and `LLM(DIR)` load: safetensors under the
format's on-disk names, config.json with its quantization_config, hf_quant_config.json (ModelOpt
formats) and the tokenizer.

Formats:
  fp8        ModelOpt FP8: E4M3 weights with one scale per tensor, static input scales from
             calibration (served W8A8 with activations quantized per token)
  fp8-block  DeepSeek / Qwen FP8: E4M3 weights with one scale per 128 x 128 block (weight_scale_inv)
  mxfp8      ModelOpt MXFP8: E4M3 weights with one E8M0 scale per 32 input columns
  nvfp4      ModelOpt NVFP4 (when this build has its encoder)

Calibration runs the float32 model over the shipped corpus (Newton's Opticks) and records the
largest |x| entering every layer and expert; weights round to nearest, or with --gptq by GPTQ
(act-order, on the Hessian of each layer's calibration inputs; NVFP4), which loses much less at
4 bits for a minute of calibration. Embeddings, norms, MoE routers and the output head
stay as the checkpoint stores them; with --draft the output head is quantized too, calibrated on
the activations of the already quantized body (for a draft model's head)."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from tokenmill.quantization.registry import QUANTIZE_FORMATS

    parser = subparsers.add_parser("quantize", help="write a quantized checkpoint (FP8, block FP8, MXFP8, NVFP4)",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory (config.json + *.safetensors) or .gguf file; default: the embedded "
                             "SmolLM2-135M-Instruct")
    parser.add_argument("--format", required=True, choices=QUANTIZE_FORMATS, help="the on-disk format (see above)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="keep checkpoint modules matching PATTERN (an fnmatch glob, a module or one of its "
                             "parents, e.g. 'model.layers.0.*' or 'mtp.*') in high precision; repeatable")
    parser.add_argument("--draft", action="store_true",
                        help="a draft model: quantize the body first, then the output head calibrated on the "
                             "activations the quantized body produces")
    parser.add_argument("--gptq", action="store_true",
                        help="round the linear layers' weights with GPTQ (each column's rounding error spread over the "
                             "columns not yet rounded, through the calibration inputs' Hessian) instead of to nearest; "
                             "the file is an ordinary checkpoint of the format (nvfp4)")
    parser.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                        help="tokens of the shipped corpus the calibration forwards read (default: 2048, or 8192 "
                             "with --gptq)")
    parser.add_argument("--device", default="cpu", help="where calibration runs: cpu or cuda")
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from tokenmill.errors import ConfigError
    from tokenmill.quantize.writer import QuantizeRequest, quantize_checkpoint

    if args.calibration_tokens is not None and args.calibration_tokens < 1:
        raise ConfigError("--calibration-tokens must be at least 1")
    out = quantize_checkpoint(QuantizeRequest(
        model=args.model, format=args.format, out=args.out, exclude=tuple(args.exclude), draft=args.draft,
        calibration_tokens=args.calibration_tokens, device=args.device, progress=not args.no_progress,
        gptq=args.gptq))
    print(f"wrote {out}")
    return 0

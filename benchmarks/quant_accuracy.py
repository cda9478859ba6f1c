"""Accuracy of `tokenmill quantize` on the real SmolLM2-135M (CPU): teacher-forced KL, top-1
agreement and perplexity of each quantized checkpoint against the model it was made from.

    python benchmarks/quant_accuracy.py [--formats fp8 fp8-block mxfp8 nvfp4 nvfp4+gptq] [--eval-tokens 4096]
                                        [--calibration-tokens 2048] [--model PATH] [--work DIR] [--json out.json]

The embedded SmolLM2 GGUF is itself Q4_1: the reference is that model as tokenmill reads it,
dequantized to float32. Each format is written by `tokenmill quantize` (calibrated on the first
tokens of the shipped corpus) and read back through its format's detection and methods. The
evaluation text is a later stretch of the same corpus (from character EVAL_OFFSET on), cut into
sequences of SEQUENCE_TOKENS tokens; every position of every sequence is scored. Float32 on the
CPU: the weights are the quantized ones, activations stay float32 (the GPU's W8A8 prefill also
rounds activations to E4M3 per token; this measures the weights).

KL is KL(reference || quantized) per position in nats, averaged; top-1 agreement is the share of
positions whose argmax agrees; perplexity is exp of the mean next-token NLL of each model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.data import shipped_corpus_text
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.loader import load_hf_config, load_tokenizer, resolve_model
from tokenmill.quantize.calibrate import SEQUENCE_TOKENS, sequence_logits
from tokenmill.quantize.writer import QuantizeRequest, quantize_checkpoint
from tokenmill.runner.model_builder import build_model, checkpoint_quantization

EVAL_OFFSET = 200_000  # characters: the calibration reads the corpus from its start


def load(path: str | None) -> CausalLM:
    source = resolve_model(path)
    hf_config = load_hf_config(source)
    quant = checkpoint_quantization(hf_config, source, use_triton=False)
    build = ModelBuild(hf_config, TorchReferenceBackend(), SEQUENCE_TOKENS, 16, torch.float32, quantization=quant)
    return build_model(build, source, dtype=torch.float32, device=torch.device("cpu"), dummy_seed=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["fp8", "fp8-block", "mxfp8"])
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--calibration-tokens", type=int, default=None, help="default: the quantize tool's")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--work", type=Path, default=None, help="where the quantized checkpoints go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="keep a format's checkpoint already written under --work")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="quant_accuracy_"))
    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    text = shipped_corpus_text()[EVAL_OFFSET: EVAL_OFFSET + 16 * args.eval_tokens]
    ids = tokenizer(text, add_special_tokens=False).input_ids[: args.eval_tokens]
    sequences = [ids[i: i + SEQUENCE_TOKENS] for i in range(0, len(ids), SEQUENCE_TOKENS)]

    models = {"reference": load(args.model)}
    for fmt in args.formats:
        started = time.perf_counter()
        out = work / fmt
        if not (args.reuse and (out / "config.json").is_file()):
            base, _, rounding = fmt.partition("+")  # "nvfp4+gptq": the format, rounded by GPTQ
            quantize_checkpoint(QuantizeRequest(args.model, base, out, calibration_tokens=args.calibration_tokens,
                                                gptq=rounding == "gptq"))
            print(f"{fmt}: quantized in {time.perf_counter() - started:.1f} s -> {out}", file=sys.stderr)
        models[fmt] = load(str(out))

    totals = {name: {"nll": 0.0, "kl": 0.0, "agree": 0} for name in models}
    positions = 0
    for sequence in sequences:
        targets = torch.tensor(sequence[1:])
        ref = torch.log_softmax(sequence_logits(models["reference"], sequence, torch.device("cpu"))[:-1].float(), -1)
        positions += len(targets)
        for name, model in models.items():
            logp = ref if name == "reference" else torch.log_softmax(
                sequence_logits(model, sequence, torch.device("cpu"))[:-1].float(), -1)
            totals[name]["nll"] -= logp.gather(1, targets[:, None]).sum().item()
            totals[name]["kl"] += (ref.exp() * (ref - logp)).sum().item()
            totals[name]["agree"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
    rows = []
    ref_ppl = math.exp(totals["reference"]["nll"] / positions)
    for name, total in totals.items():
        ppl = math.exp(total["nll"] / positions)
        rows.append({"model": name, "perplexity": ppl, "ppl_change": ppl / ref_ppl - 1, "kl_nats": total["kl"] / positions,
                     "top1_agreement": total["agree"] / positions, "positions": positions})
    print(f"{'model':>10} | {'perplexity':>10} | {'vs ref':>8} | {'KL (nats)':>10} | {'top-1 agree':>11}")
    for row in rows:
        print(f"{row['model']:>10} | {row['perplexity']:10.3f} | {100 * row['ppl_change']:+7.2f}% | "
              f"{row['kl_nats']:10.5f} | {100 * row['top1_agreement']:10.2f}%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

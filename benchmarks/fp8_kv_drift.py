"""How many greedy tokens change when the KV cache is FP8 instead of the model dtype (SmolLM2).

    python benchmarks/fp8_kv_drift.py [--device cpu|cuda] [--tokens 64]

FP8 runs twice: every layer's k/v scale at 1.0 (`--no-calculate-kv-scales`, vLLM's default for
a checkpoint without scales) and with scales calibrated at start-up (`--calculate-kv-scales`).
For each prompt of a fixed set: the position of the first differing token (or none) and the
number of positions that differ; a changed token changes everything after it, so the first
divergence is the honest figure. A changed token also depends on how close the top two
logits were, so each configuration is also run teacher-forced on the exact model's own
continuation: positions whose argmax differs, and the mean KL(exact || fp8) over positions.
"""

from __future__ import annotations

import argparse

import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "def quicksort(xs):",
    "The three laws of thermodynamics are",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List five prime numbers:",
    "Once upon a time, a young fox",
    "Explain photosynthesis in one sentence.",
    "The meaning of the word 'ephemeral' is",
    "SELECT name FROM users WHERE",
    "In 1969, the first humans",
    "A good breakfast includes",
    "The difference between a list and a tuple in Python is",
    "Water boils at",
    "My favourite book is",
    "To make a cup of tea, first",
]


def greedy(args: argparse.Namespace, **options: object) -> tuple[list[list[int]], LLM]:
    # No prefix caching: the teacher-forced pass must compute every position.
    llm = LLM(device=args.device, kv_cache_bytes=1 << 28, max_model_len=1024, enable_prefix_caching=False, **options)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm


def teacher_forced(llm: LLM, continuations: list[list[int]]) -> list[torch.Tensor]:
    """Log-probabilities [tokens, vocab] at each position of prompt + continuation, one prefill per prompt."""
    model = llm.engine.runner.model
    hidden: list[torch.Tensor] = []
    forward = model.forward
    model.forward = lambda *args: hidden.append(forward(*args)) or hidden[-1]  # type: ignore[method-assign]
    out = []
    try:
        for prompt, continuation in zip(PROMPTS, continuations):
            hidden.clear()
            llm.generate([list(llm.tokenizer(prompt).input_ids) + continuation[:-1]],
                         SamplingParams(temperature=0, max_tokens=1))
            with torch.inference_mode():
                out.append(model.compute_logits(hidden[0][-len(continuation):]).float().log_softmax(-1).cpu())
    finally:
        model.forward = forward  # type: ignore[method-assign]
    return out


def report_teacher_forced(title: str, exact: list[torch.Tensor], quantized: list[torch.Tensor]) -> None:
    flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(exact, quantized))
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(exact, quantized)])
    print(f"{title}, teacher-forced: argmax differs at {flips}/{kl.numel()} positions; "
          f"KL(exact || fp8) mean {kl.mean():.2e}, max {kl.max():.2e}")


def report(title: str, tokens: int, baseline: list[list[int]], quantized: list[list[int]]) -> None:
    changed_prompts = total_changed = 0
    print(f"\n{title}\n\n| prompt | first differing token (of {tokens}) | tokens differing |\n|---|---|---|")
    for prompt, a, b in zip(PROMPTS, baseline, quantized):
        diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        changed_prompts += bool(diffs)
        total_changed += len(diffs)
        print(f"| {prompt[:40]} | {diffs[0] if diffs else '-'} | {len(diffs)} |")
    total = len(PROMPTS) * tokens
    print(f"\n{title}: {changed_prompts}/{len(PROMPTS)} prompts diverge; "
          f"{total_changed}/{total} greedy tokens differ ({100 * total_changed / total:.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    baseline, exact = greedy(args)
    dtype = exact.engine.config.model.dtype
    exact_logprobs = teacher_forced(exact, baseline)
    del exact
    unscaled, fp8 = greedy(args, kv_cache_dtype="fp8", calculate_kv_scales=False)
    unscaled_logprobs = teacher_forced(fp8, baseline)
    del fp8
    calibrated, fp8 = greedy(args, kv_cache_dtype="fp8", calculate_kv_scales=True)
    calibrated_logprobs = teacher_forced(fp8, baseline)
    layers = fp8.engine.runner.model.scaled_cache_layers()
    k_scales, v_scales = [a.k_scale for a in layers], [a.v_scale for a in layers]
    report(f"KV {dtype} vs fp8, scales 1.0, on {args.device}", args.tokens, baseline, unscaled)
    report(f"KV {dtype} vs fp8, calibrated scales, on {args.device}", args.tokens, baseline, calibrated)
    print(f"calibrated k_scale {min(k_scales):.3g}..{max(k_scales):.3g}, v_scale {min(v_scales):.3g}..{max(v_scales):.3g}\n")
    report_teacher_forced("scales 1.0", exact_logprobs, unscaled_logprobs)
    report_teacher_forced("calibrated scales", exact_logprobs, calibrated_logprobs)


if __name__ == "__main__":
    main()

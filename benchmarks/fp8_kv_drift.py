"""How many greedy tokens change when the KV cache is FP8 instead of the model dtype (SmolLM2).

    python benchmarks/fp8_kv_drift.py [--device cpu|cuda] [--tokens 64]

For each prompt of a fixed set: the position of the first differing token (or none) and the
number of positions that differ; a changed token changes everything after it, so the first
divergence is the honest figure.
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    exact = LLM(device=args.device, kv_cache_bytes=1 << 28, max_model_len=1024)
    baseline = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, params)]
    dtype = exact.engine.config.model.dtype
    del exact
    fp8 = LLM(device=args.device, kv_cache_bytes=1 << 28, max_model_len=1024, kv_cache_dtype="fp8")
    quantized = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, params)]

    changed_prompts = total_changed = 0
    print(f"| prompt | first differing token (of {args.tokens}) | tokens differing |\n|---|---|---|")
    for prompt, a, b in zip(PROMPTS, baseline, quantized):
        diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        changed_prompts += bool(diffs)
        total_changed += len(diffs)
        print(f"| {prompt[:40]} | {diffs[0] if diffs else '-'} | {len(diffs)} |")
    total = len(PROMPTS) * args.tokens
    print(f"\nKV {dtype} vs fp8 on {args.device}: {changed_prompts}/{len(PROMPTS)} prompts diverge; "
          f"{total_changed}/{total} greedy tokens differ ({100 * total_changed / total:.1f}%)")


if __name__ == "__main__":
    main()

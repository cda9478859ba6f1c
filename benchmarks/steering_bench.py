"""What per-request refusal steering costs in decode throughput (Llama-3.1-8B shape, random weights).

Two engines on one GPU from the same seeded random checkpoint: one started without --steering,
one with a steering file (a random unit direction) for that model. Each measures decode tok/s at
batch 1 and 64 (as gpu_bench.py: (t(N+1) - t(1)) / N, prefill excluded, CUDA graphs on) with every
request at strength 1 (and 0, and a mix); the engines alternate (A B A B ...) so drift cancels,
and each figure is the median of the rounds. Target: steering at strength != 0 costs <= 3%.

    python benchmarks/steering_bench.py [--tokens 128] [--rounds 2] [--json out.json]
    python benchmarks/steering_bench.py --smoke     # a tiny Llama on CPU: the script runs end to end
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import LLAMA_31_8B  # noqa: E402  (beside this script)

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.models.steering_file import SteeringDirection, SteeringFile, model_identity, save_steering_file  # noqa: E402

TINY = {**LLAMA_31_8B, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "rope_scaling": None,
        "bos_token_id": 1, "eos_token_id": 2}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(llm: LLM, batch: int, new_tokens: int, strengths: list[float] | None, device: str,
                prompt_len: int = 128, seed: int = 0) -> float:
    """Decode tok/s of `batch` fresh random prompts: batch * N / (t(N + 1) - t(1)), medians of three."""
    rng = random.Random(seed)
    vocab = llm.engine.hf_config.vocab_size

    def run(n: int) -> float:
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        steering = None if strengths is None else [{"refusal": strengths[i % len(strengths)]} for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        sync(device)
        start = time.perf_counter()
        llm.generate(prompts, params, steering=steering)
        sync(device)
        return time.perf_counter() - start

    run(4), run(4)
    one = statistics.median(run(1) for _ in range(3))
    many = statistics.median(run(new_tokens + 1) for _ in range(3))
    return batch * new_tokens / (many - one)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on CPU, few tokens (checks the script)")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating A/B rounds; each figure is their median")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    config = TINY if args.smoke else LLAMA_31_8B
    tokens = 8 if args.smoke else args.tokens
    batches = [1, 4] if args.smoke else [int(b) for b in args.batches.split(",")]
    rounds = 1 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        common = dict(load_format="dummy", device=device, dtype="float32" if args.smoke else "bfloat16",
                      max_model_len=1024, max_num_seqs=max(batches), kv_cache_bytes=(1 << 26) if args.smoke else (4 << 30),
                      enforce_eager=args.smoke)
        plain = LLM(tmp, **common)
        model = plain.engine.runner.model
        vector = torch.randn(config["hidden_size"], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        file = SteeringFile(model_identity(model, plain.engine.hf_config, plain.engine.model_name),
                            {"refusal": SteeringDirection("refusal", config["num_hidden_layers"] // 2,
                                                          vector / vector.norm())})
        save_steering_file(Path(tmp) / "steer", file)
        steered = LLM(tmp, **common, steering=str(Path(tmp) / "steer"))
        runs = {"unsteered": (plain, None), "strength 1": (steered, [1.0]), "strength 0": (steered, [0.0]),
                "mixed 0/0.5/1": (steered, [0.0, 0.5, 1.0])}
        figures: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in runs}
        for _ in range(rounds):
            for batch in batches:
                for name, (llm, strengths) in runs.items():
                    figures[name][batch].append(decode_rate(llm, batch, tokens, strengths, device))
    rates = {name: {b: statistics.median(v) for b, v in per.items()} for name, per in figures.items()}
    print(f"\n{'Llama-3.1-8B shape, bf16, CUDA graphs' if not args.smoke else 'tiny Llama, CPU (smoke)'}; "
          f"decode tok/s after 128 prompt tokens, {tokens} tokens, median of {rounds} alternating rounds\n")
    print("| batch | " + " | ".join(runs) + " | cost at strength 1 |\n|---" * 1 + "|---" * (len(runs) + 1) + "|")
    worst = 0.0
    for batch in batches:
        cost = 1 - rates["strength 1"][batch] / rates["unsteered"][batch]
        worst = max(worst, cost)
        print(f"| {batch} | " + " | ".join(f"{rates[n][batch]:,.1f}" for n in runs) + f" | {100 * cost:+.2f}% |")
    print(f"\ntarget: steering at strength != 0 costs <= 3% of decode throughput: {'PASS' if worst <= 0.03 else 'FAIL'} "
          f"(worst {100 * worst:+.2f}%)")
    if args.json:
        args.json.write_text(json.dumps({"rates": rates, "rounds": figures, "worst_cost": worst}, indent=2))
    return 0 if args.smoke or worst <= 0.03 else 1


if __name__ == "__main__":
    sys.exit(main())

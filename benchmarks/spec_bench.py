"""Speculative decoding on one GPU: what a verify step costs, and decode speed with drafts.

Target of Llama-3.1-8B shape, draft of Llama-3.2-1B shape, both random (load_format=dummy),
so a real draft's acceptance cannot be measured here; the figures are the machinery's:
  - the cost of a (1 + gamma)-token verify forward against a 1-token forward at batch 1/16/64;
  - batch-1 decode tok/s without speculation, with the n-gram proposer on a repetitive prompt,
    and with the draft model under BENCHMARK-ONLY accept-all verification (not lossless: it
    shows the speed-up at full acceptance, acceptance length gamma + 1).

    python benchmarks/spec_bench.py [--gamma 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import LLAMA_31_8B, decode_rate  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import BENCHMARK_ACCEPT_ALL, BENCHMARK_ACCEPT_ALL_ENV  # noqa: E402
from tokenmill.runner.batch import Chunk, pack  # noqa: E402

LLAMA_32_1B = {
    **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0},
}


def forward_ms(llm: LLM, batch: int, tokens_per_request: int, context: int = 512) -> float:
    """Median time of one eager target forward: `batch` requests adding `tokens_per_request` each."""
    runner = llm.engine.runner
    blocks = -(-(context + tokens_per_request) // runner.block_size)
    chunks = [Chunk([7] * tokens_per_request, context, list(range(b * blocks, (b + 1) * blocks))) for b in range(batch)]
    ids, positions, metadata = pack(chunks, runner.block_size, runner.device)
    times = []
    with torch.inference_mode():
        for _ in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hidden = runner.model(ids, positions, metadata)
            runner.model.compute_logits(hidden)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def repetitive_rate(llm: LLM, new_tokens: int) -> float:
    """Decode tok/s continuing a prompt that repeats itself (what prompt lookup feeds on)."""
    prompt = list(range(1000, 1064)) * 8
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    figures: dict[str, float] = {}

    def report(name: str, value: float, unit: str) -> None:
        figures[name] = value
        print(f"{name:<58} {value:>10,.2f} {unit}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = Path(tmp, "target"), Path(tmp, "draft")
        for path, config in ((target_dir, LLAMA_31_8B), (draft_dir, LLAMA_32_1B)):
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
        common = dict(load_format="dummy", dtype="bfloat16", max_model_len=8192, kv_cache_bytes=24 << 30)
        plain = LLM(str(target_dir), **common)
        for batch in (1, 16, 64):
            one, many = forward_ms(plain, batch, 1), forward_ms(plain, batch, 1 + args.gamma)
            report(f"verify forward cost, bs={batch}: (1+{args.gamma}) tokens / 1 token", many / one, "x")
        base = decode_rate(plain, 128, args.tokens)
        report("bs=1 decode, no speculation (CUDA graphs)", base, "tok/s")
        base_rep = repetitive_rate(plain, args.tokens)
        del plain
        torch.cuda.empty_cache()

        ngram = LLM(str(target_dir), **common, speculative_config={"method": "ngram", "num_speculative_tokens": args.gamma})
        rate = repetitive_rate(ngram, args.tokens)
        report("bs=1 decode, n-gram, repetitive prompt (random weights)", rate, "tok/s")
        report("  ratio to no speculation on the same prompt", rate / base_rep, "x")
        report("  mean acceptance length", ngram.engine.spec_stats.mean_acceptance_length, "")
        del ngram
        torch.cuda.empty_cache()

        os.environ[BENCHMARK_ACCEPT_ALL_ENV] = "1"
        draft = LLM(str(target_dir), **common, speculative_config={
            "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": args.gamma,
            "draft_sampling": "greedy", "verification": BENCHMARK_ACCEPT_ALL})
        rate = decode_rate(draft, 128, args.tokens)
        report("BENCHMARK-ONLY accept-all: bs=1 decode, 1B-shape draft", rate, "tok/s")
        report("  ratio to no speculation", rate / base, "x")
        report("  mean acceptance length", draft.engine.spec_stats.mean_acceptance_length, "")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

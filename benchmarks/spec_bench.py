"""Speculative decoding on one GPU: what a verify step costs, and decode speed with drafts.

Target of Llama-3.1-8B shape, draft of Llama-3.2-1B shape, both random (load_format=dummy),
so a real draft's acceptance cannot be measured here; the figures are the machinery's:
  - the cost of a (1 + gamma)-token verify step against a 1-token step at batch 1/16/64, both
    as the engine runs them (captured CUDA graphs, device time), and of a step with fewer
    drafts run eagerly against the same step padded into the verify graph (wall time);
  - batch-1 decode tok/s without speculation, with the n-gram proposer on a repetitive prompt,
    and with the draft model under BENCHMARK-ONLY accept-all verification (not lossless: it
    shows the speed-up at full acceptance, acceptance length gamma + 1), with its full head and
    with the head cut to a 32k-token draft vocabulary; beside each, the ratio the captured
    steps allow with no host time at all (catch-up + (gamma - 1) draft steps + verify against
    gamma + 1, or 3.5, plain steps);
  - with --acceptance-length L, the accept-all parts accept by a fixed BENCHMARK-ONLY pattern
    of mean acceptance length L instead (e.g. 2, 3, 2, 3, ... drafts for 3.5; the rest rolled
    back as real rejections are), so the rate at a given acceptance length is measured, not
    only bounded.

    python benchmarks/spec_bench.py [--gamma 4] [--parts cost,ngram,accept,vocab] [--vocab-gammas 4,6]
                                    [--draft-quantization fp8] [--acceptance-length 3.5]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import LLAMA_31_8B, decode_rate, median_time, replay_seconds  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.config import BENCHMARK_ACCEPT_ALL, BENCHMARK_ACCEPT_ALL_ENV  # noqa: E402
from tokenmill.runner.batch import Chunk, pack  # noqa: E402
from tokenmill.runner.cuda_graphs import StepGraphs  # noqa: E402
from tokenmill.runner.model_runner import ModelRunner  # noqa: E402

LLAMA_32_1B = {
    **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0},
}


def graph_step_ms(graphs: StepGraphs, batch: int, context: int, repeats: int = 20) -> float:
    """Median device time of one captured step: `batch` requests of `context` tokens each adding
    graphs.query_len tokens (the replayed graph is the one the engine would pick)."""
    q, size = graphs.query_len, graphs.block_size
    blocks = -(-context // size)
    positions = torch.arange(context - q, context)
    for b in range(batch):
        table = torch.arange(b * blocks, (b + 1) * blocks, dtype=torch.int32)
        graphs.block_tables[b, :blocks] = table
        graphs.seq_lens[b] = context
        graphs.positions[b * q : (b + 1) * q] = positions
        graphs.slot_mapping[b * q : (b + 1) * q] = table[positions // size].long() * size + positions % size
    bucket = graphs.buckets[bisect.bisect_left(graphs.buckets, batch)]
    graph = graphs.graphs[bucket, graphs.contexts[bisect.bisect_left(graphs.contexts, context)]]
    return 1e3 * replay_seconds(graph.replay, repeats)


def ragged_step_ms(runner: ModelRunner, verify: StepGraphs, rows: int, context: int, padded: bool) -> float:
    """Wall milliseconds (host launches included) of one bs=1 step adding `rows` tokens, every
    one sampled: eager, or padded into the verify graph as the runner does it."""
    table = list(range(-(-context // runner.block_size)))
    ids, positions, metadata = pack([Chunk([0] * rows, context - rows, table)], runner.block_size, runner.device)
    model = runner.model

    def step() -> torch.Tensor:
        if padded:
            return verify.run_padded(ids, metadata)
        return model.compute_logits(model(ids, positions, metadata))

    with torch.inference_mode():
        return 1e3 * median_time(step, repeats=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--vocab-gammas", default="",
                        help="comma-separated gammas for the draft-vocabulary part (default: --gamma)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft-quantization", choices=["fp8"], default=None,
                        help="quantize the draft's weights at load (the accept-all parts)")
    parser.add_argument("--acceptance-length", type=float, default=None,
                        help="the accept-all parts accept by a fixed pattern of this mean acceptance length instead "
                             "(benchmark-only), e.g. 3.5: the issue's target, measured")
    parser.add_argument("--parts", default="cost,ngram,accept,vocab",
                        help="verify-step cost, n-gram decode, accept-all decode, accept-all with a 32k draft vocabulary")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    figures: dict[str, float] = {}

    def report(name: str, value: float, unit: str) -> None:
        figures[name] = value
        print(f"{name:<58} {value:>10,.2f} {unit}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = Path(tmp, "target"), Path(tmp, "draft")
        for path, config in ((target_dir, LLAMA_31_8B), (draft_dir, LLAMA_32_1B)):
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
        common = dict(load_format="dummy", dtype="bfloat16", max_model_len=8192, kv_cache_bytes=24 << 30, max_num_seqs=64)
        repetitive = list(range(1000, 1064)) * 8
        plain = LLM(str(target_dir), **common)
        base = decode_rate(plain, 128, args.tokens)
        report("bs=1 decode, no speculation (CUDA graphs)", base, "tok/s")
        base_rep = decode_rate(plain, len(repetitive), args.tokens, prompt=repetitive)
        report("bs=1 decode, no speculation, repetitive prompt", base_rep, "tok/s")
        del plain
        torch.cuda.empty_cache()

        if parts & {"cost", "ngram"}:
            ngram = LLM(str(target_dir), **common, speculative_config={"method": "ngram", "num_speculative_tokens": args.gamma})
            decode, verify = ngram.engine.runner.graphs
            for batch in (1, 16, 64) if "cost" in parts else ():
                one, many = graph_step_ms(decode, batch, 512), graph_step_ms(verify, batch, 512)
                report(f"verify step cost, bs={batch}, ctx 512: (1+{args.gamma}) / 1 token (graphs)", many / one, "x")
                report(f"  1-token step / verify step, bs={batch}", one, f"/ {many:.3f} ms")
            for rows in range(2, args.gamma + 1) if "cost" in parts else ():
                eager, padded = (ragged_step_ms(ngram.engine.runner, verify, rows, 512, p) for p in (False, True))
                report(f"step of {rows} sampled tokens, bs=1, ctx 512: eager / padded into the verify graph", eager / padded,
                       "x")
                report(f"  eager / padded (wall, host launches included), {rows} tokens", eager, f"/ {padded:.3f} ms")
            if "ngram" in parts:
                rate = decode_rate(ngram, len(repetitive), args.tokens, prompt=repetitive, first=2)
                report("bs=1 decode, n-gram, repetitive prompt (random weights)", rate, "tok/s")
                report("  ratio to no speculation on the same prompt", rate / base_rep, "x")
                report("  n-gram mean acceptance length", ngram.engine.spec_stats.mean_acceptance_length, "")
            del ngram, decode, verify
            torch.cuda.empty_cache()

        os.environ[BENCHMARK_ACCEPT_ALL_ENV] = "1"
        if "accept" in parts:
            accept_all_decode(target_dir, draft_dir, common, args.gamma, args.tokens, base, report, None,
                              args.draft_quantization, args.acceptance_length)
        if "vocab" in parts:
            # The draft's head cut to a 32k-token draft vocabulary (the head is 21% of the 1B's
            # bytes): what `tokenmill draft-vocab build` buys at full acceptance.
            vocab_file = Path(tmp, "draft_vocab.npy")
            numpy.save(vocab_file, numpy.arange(32768, dtype=numpy.int64))
            for gamma in [int(g) for g in args.vocab_gammas.split(",") if g] or [args.gamma]:
                accept_all_decode(target_dir, draft_dir, common, gamma, args.tokens, base, report, vocab_file,
                                  args.draft_quantization, args.acceptance_length)
    print(json.dumps(figures))


def accept_all_decode(target_dir: Path, draft_dir: Path, common: dict, gamma: int, tokens: int, base: float,
                      report: Callable[[str, float, str], None], draft_vocab: Path | None,
                      quantization: str | None, length: float | None = None) -> None:
    """BENCHMARK-ONLY accept-all decoding at bs=1 with the 1B-shape draft (optionally with a draft
    vocabulary and quantized weights; with `length`, drafts accepted by a fixed pattern of that
    mean acceptance length instead of all)."""
    label = f", gamma {gamma}" + ("" if draft_vocab is None else ", 32k draft vocabulary")
    label += f", {quantization} draft" if quantization else ""
    mode = "accept-all" if length is None else f"fixed acceptance length {length}"
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": gamma,
            "draft_sampling": "greedy", "verification": BENCHMARK_ACCEPT_ALL}
    if length is not None:
        spec["benchmark_acceptance_length"] = length
    if draft_vocab is not None:
        spec["draft_vocab"] = str(draft_vocab)
    if quantization:
        spec["quantization"] = quantization
    draft = LLM(str(target_dir), **common, speculative_config=spec)
    rate = decode_rate(draft, 128, tokens, first=2)
    report(f"BENCHMARK-ONLY {mode}: bs=1 decode, 1B-shape draft{label}", rate, "tok/s")
    report(f"  ratio to no speculation{label}", rate / base, "x")
    report(f"  {mode}: mean acceptance length{label}", draft.engine.spec_stats.mean_acceptance_length, "")
    proposer = draft.engine.proposer
    one, verify = (graph_step_ms(g, 1, 512) for g in draft.engine.runner.graphs)
    draft_ms, catch_up_ms = graph_step_ms(proposer.decode_graphs, 1, 512), graph_step_ms(proposer.catch_up_graphs, 1, 512)
    report(f"  draft decode step, bs=1 (graph){label}", draft_ms, "ms")
    report(f"  draft catch-up step, bs=1 (graph){label}", catch_up_ms, "ms")
    # A cycle's device time with no host time at all: the catch-up drafts the first token,
    # gamma - 1 decode steps the rest, then the verify step; a plain step makes one token.
    cycle = catch_up_ms + (gamma - 1) * draft_ms + verify
    report(f"  device-only ceiling at full acceptance ({gamma + 1} tokens per {cycle:.2f} ms){label}",
           (gamma + 1) * one / cycle, "x")
    report(f"  device-only ceiling at acceptance length 3.5{label}", 3.5 * one / cycle, "x")
    del draft, proposer
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Block-drafter (DFlash / DFlash2) speculation on one GPU: a Llama-3.1-8B-shape target with a
random DFlash-shape drafter (load_format=dummy: random weights accept nothing of their own), the
drafts accepted by the BENCHMARK-ONLY fixed pattern of mean acceptance length L (not lossless:
accepted by pattern, the rest rolled back as real rejections are), in the same run as plain
decoding. Issue 26's targets: at block size 16 (gamma 15), bs=1 decode >= 3.5x plain at L = 6
and >= 2.5x at L = 3.5; the drafter's block forward <= 10% of a target decode step; batch 16 >=
1.0x (or speculation turns itself off past disable_by_batch_size).

Parts (each builds the plain engine and one drafter engine, under 3 minutes on an H200):
  rates   bs=1 decode tok/s without and with the drafter at each --acceptance-lengths, the ratio;
  steps   captured-graph device times at bs=1, 512 tokens: target decode and verify steps, the
          drafter's context write (1 + gamma rows) and block forward, the block as a fraction of
          a decode step, and the device-only ceiling of a cycle (verify + context + block);
  cycle   one long request's steady state timed by CUDA events around every graph replay: per
          cycle, device ms in the verify graphs, in the drafter's graphs, and between graphs (the
          host's part: proposing, scheduling, resolving; eager ops; idle);
  batch16 decode tok/s per request at batch 16 without and with the drafter, the ratio.

The drafter (--kind dflash: z-lab/dflash's DFlashDraftModel shape for an 8B target: hidden 4096,
--draft-layers 5 Qwen3-style layers of the target's MLP width, 32 / 8 heads of 128, fc over
target layers [1, 8, 15, 22, 29]; dflash2 adds the two-tap grouped convolutions and a rank-256,
top-16 selector) shares the target's embedding; its weights and its own copy of the output head
are quantized at load by --draft-quantization (nvfp4: W4A16 on Hopper, the deployment's; fp8;
none: bf16, sharing the target's head); its KV cache is bf16 beside a bf16 or --kv-cache-dtype
fp8 target cache.

    python benchmarks/dflash_bench.py [--parts rates,steps,cycle,batch16] [--kind dflash|dflash2]
        [--gamma 15] [--acceptance-lengths 6,3.5] [--draft-quantization nvfp4|fp8|none]
        [--draft-layers 5] [--kv-cache-dtype auto|fp8] [--tokens 128] [--json out.json]
    python benchmarks/dflash_bench.py --smoke   # tiny shapes on CPU, wall time: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import FigureTable  # noqa: E402
from gpu_bench import LLAMA_31_8B  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import BenchmarkOnlyConfig  # noqa: E402
from tokenmill.models.dflash_config import build_target_layer_ids  # noqa: E402
from tokenmill.speculative.stats import SpecStats  # noqa: E402

TINY_TARGET = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}


def drafter_config(target: dict, kind: str, layers: int, block_size: int) -> dict:
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    config = {
        "architectures": ["DFlashDraftModel" if kind == "dflash" else "DFlash2DraftModel"], "model_type": "qwen3",
        "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"], "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": target["hidden_size"] // heads,
        "vocab_size": target["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": target["rope_theta"],
        "max_position_embeddings": target["max_position_embeddings"], "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "dflash_config": {"target_layer_ids": list(build_target_layer_ids(target["num_hidden_layers"], layers)),
                          "mask_token_id": target["vocab_size"] - 1},
    }
    if kind == "dflash2":
        config["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
    return config


def decode_rate(llm: LLM, prompt_len: int, new_tokens: int, batch: int = 1, seed: int = 0) -> float:
    """Decode tok/s per request as (t(N + 1) - t(1)) / N: prefill excluded (fresh random prompts
    each run, so no prefix-cache hit favours either side)."""
    cuda = llm.engine.runner.device.type == "cuda"
    rng = random.Random(seed)
    vocab = llm.engine.hf_config.vocab_size

    def run(n: int) -> float:
        prompts = [[rng.randrange(2, vocab - 1) for _ in range(prompt_len)] for _ in range(batch)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4)
    one = statistics.median(run(1) for _ in range(3))
    many = statistics.median(run(new_tokens + 1) for _ in range(3))
    return new_tokens / (many - one)


def with_length(llm: LLM, length: float) -> None:
    """The engine's BENCHMARK-ONLY fixed acceptance length, changed in place (stats reset)."""
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, benchmark_only=BenchmarkOnlyConfig(True, length))
    engine.spec_stats = SpecStats()


def free(*llms: LLM) -> None:
    del llms
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def steps(llm: LLM, gamma: int, lengths: list[float], report) -> None:
    from spec_bench import graph_step_ms

    runner, proposer = llm.engine.runner, llm.engine.proposer
    decode, verify = (graph_step_ms(g, 1, 512) for g in runner.graphs)
    context = graph_step_ms(proposer.context_graphs[1 + gamma], 1, 512)
    block = graph_step_ms(proposer.block_graphs, 1, 512)
    report("target decode step, bs=1 @ 512 (graph)", decode, "ms")
    report(f"target verify step ({1 + gamma} rows, graph)", verify, "ms", decode, "a decode step")
    report(f"drafter context write ({1 + gamma} rows, graph)", context, "ms", decode, "a decode step")
    report(f"drafter block forward ({1 + gamma} rows, graph; target <= 10%)", block, "ms", decode, "a decode step")
    cycle = verify + context + block
    for length in lengths:
        report(f"  device-only ceiling at acceptance length {length}", length * decode / cycle, "x")


def steady_cycle(llm: LLM, length: float, base: float, report, tokens: int = 1024) -> None:
    """Device time per cycle inside the verify graphs, the drafter's graphs and between graphs."""
    runner, proposer = llm.engine.runner, llm.engine.proposer
    families = [*runner.graphs, *proposer.context_graphs.values(), proposer.block_graphs]
    names = {id(g): family.name for family in families for g in family.graphs.values()}
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        marks.append((names.get(id(graph), "other"), start, end))

    with_length(llm, length)
    llm.generate([list(range(1000, 1128))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    torch.cuda.CUDAGraph.replay = timed
    try:
        llm.generate([list(range(2000, 2128))], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    finally:
        torch.cuda.CUDAGraph.replay = replay
    torch.cuda.synchronize()
    verifies = [i for i, (name, _, _) in enumerate(marks) if name == "verify"]
    steady = marks[verifies[4] + 1 : verifies[-4] + 1]  # whole cycles, each ending with its verify step
    cycles = len(verifies) - 8
    inside: dict[str, float] = {}
    for name, start, end in steady:
        kind = "verify" if name == "verify" else "draft" if name.startswith("DFlash") else name
        inside[kind] = inside.get(kind, 0.0) + start.elapsed_time(end) / cycles
    span = steady[0][1].elapsed_time(steady[-1][2]) / cycles
    achieved = llm.engine.spec_stats.mean_acceptance_length
    label = f"acceptance length {length}"
    for kind, ms in sorted(inside.items()):
        report(f"  cycle @ {label}: {kind} (device ms in graphs)", ms, "ms", span, "a cycle")
    report(f"  cycle @ {label}: host, eager ops, idle (between graphs)", span - sum(inside.values()), "ms", span, "a cycle")
    report(f"cycle @ {label} ({cycles} cycles, measured length {achieved:.2f}): ms per cycle", span, "ms")
    report(f"  steady-state ratio to no speculation @ {label}", 1e3 * achieved / span / base, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="rates,steps,cycle,batch16")
    parser.add_argument("--kind", choices=("dflash", "dflash2"), default="dflash")
    parser.add_argument("--gamma", type=int, default=15, help="drafts per block (block size gamma + 1)")
    parser.add_argument("--acceptance-lengths", default="6,3.5", help="BENCHMARK-ONLY fixed patterns' means")
    parser.add_argument("--draft-quantization", choices=("nvfp4", "fp8", "none"), default="nvfp4")
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="the target's KV cache")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per timed run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, wall time (checks the script)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    lengths = [float(x) for x in args.acceptance_lengths.split(",")]
    table = FigureTable(66)
    report = table.report
    target = TINY_TARGET if args.smoke else LLAMA_31_8B
    common = dict(device="cpu" if args.smoke else "cuda", load_format="dummy",
                  dtype="float32" if args.smoke else "bfloat16", max_model_len=2048 if args.smoke else 8192,
                  max_num_seqs=16, kv_cache_bytes=(1 << 26) if args.smoke else (16 << 30), kv_cache_dtype=args.kv_cache_dtype)
    tokens = 16 if args.smoke else args.tokens
    batch = 2 if args.smoke else 16
    spec = {"method": args.kind, "num_speculative_tokens": args.gamma, "draft_sampling": "greedy"}
    if args.draft_quantization != "none":
        spec["quantization"] = args.draft_quantization
    print(f"{'tiny Llama' if args.smoke else 'Llama-3.1-8B shape'} target, {args.kv_cache_dtype} KV; {args.kind} drafter "
          f"of {args.draft_layers} layers, {args.draft_quantization} weights, block {args.gamma + 1}; BENCHMARK-ONLY fixed "
          f"acceptance lengths {lengths}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = Path(tmp, "target"), Path(tmp, "draft")
        for path, config in ((target_dir, target),
                             (draft_dir, drafter_config(target, args.kind, args.draft_layers, args.gamma + 1))):
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
        spec["model"] = str(draft_dir)
        plain = LLM(str(target_dir), **common)
        base = decode_rate(plain, 128, tokens)
        report("decode bs=1 @ 128, no speculation", base, "tok/s")
        base_batch = decode_rate(plain, 128, tokens, batch=batch) if "batch16" in parts else 0.0
        free(plain)
        llm = LLM(str(target_dir), **common, speculative_config=spec,
                  benchmark_only=BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=lengths[0]))
        for length in lengths if "rates" in parts else ():
            with_length(llm, length)
            rate = decode_rate(llm, 128, tokens)
            report(f"decode bs=1 @ 128, {args.kind} @ acceptance length {length}", rate, "tok/s")
            report(f"  ratio to no speculation @ {length}", rate / base, "x")
            report(f"  mean acceptance length measured @ {length}", llm.engine.spec_stats.mean_acceptance_length, "")
        if not args.smoke and "steps" in parts:
            steps(llm, args.gamma, lengths, report)
        if not args.smoke and "cycle" in parts:
            for length in lengths:
                steady_cycle(llm, length, base, report)
        for length in lengths if "batch16" in parts else ():
            with_length(llm, length)
            rate = decode_rate(llm, 128, tokens, batch=batch)
            report(f"decode bs={batch} @ 128 per request, {args.kind} @ {length} (plain {base_batch:.1f})", rate, "tok/s")
            report(f"  bs={batch} ratio to no speculation @ {length} (target >= 1.0)", rate / base_batch, "x")
        free(llm)
    table.finish(args.json)


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes, on one GPU (Llama-3.1-8B shape, random weights).

    python benchmarks/decode_profile.py [--skip gemv,routes,kernels,spec]

  gemv     each projection of the target and the draft at M = 1, 2, 5, 8 rows (--gemv-rows):
           cuBLAS (torch's linear) against tokenmill's few-row kernels (FMA; from M = 2 also the
           tensor-core one) with their chosen tiles and a few others (--gemv-sweep), bf16 and
           (draft) FP8 weights, every weight cycled through copies
           larger than L2; GB/s and ratio to the copy rate.
  routes   the captured decode step at batch 1 to 16 (context 512): replay time of the engine
           against one with 2-16 rows on cuBLAS instead of the tensor-core kernel (interleaved;
           batch 1, the same kernels in both, is the control); ratio of engine time to it.
  kernels  one captured decode step (context 128, and 32k with FP8 KV) under the profiler:
           device time per kernel family, their sum against the replay's wall time (the
           gaps between kernels), and the engine's tok/s against the bare replay rate (what
           the host loop and the sampler add).
  spec     plain and speculative decoding (1B-shape FP8 draft with a 32k draft vocabulary, gamma 3,
           fixed acceptance length 3.5: the issue's target) under the profiler: how
           long the GPU idles per step, attributed to the host phase running at the time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import LLAMA_31_8B, copy_bandwidth, decode_rate, graph_time, replay_seconds  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kernels.few_row_mma import few_row_mma, few_row_mma_tile  # noqa: E402
from tokenmill.kernels.gemv import MAX_ROWS, GemvTile, gemv, gemv_tile  # noqa: E402
from tokenmill.kv.planner import bytes_per_block  # noqa: E402
from tokenmill.quantization import fp8_rows  # noqa: E402
from tokenmill.runner.cuda_graphs import StepGraphs  # noqa: E402

L2_BYTES = 64 << 20
PROJECTIONS = {  # name: (N, K) of Llama-3.1-8B
    "qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336), "lm_head": (128256, 4096),
}
DRAFT_PROJECTIONS = {"1B qkv_proj": (3072, 2048), "1B o_proj": (2048, 2048), "1B gate_up": (16384, 2048),
                     "1B down": (2048, 8192), "1B head 32k": (32768, 2048)}
ROW_TILES = [GemvTile(n, k, w, s) for n, k, w, s in ((2, 256, 4, 4), (4, 256, 4, 4), (8, 128, 4, 4), (4, 512, 8, 3))]
TILES = [GemvTile(n, k, w, s) for n, k, w, s in (
    (4, 512, 4, 4), (8, 256, 4, 4), (8, 512, 4, 3), (8, 512, 4, 4), (8, 512, 8, 4), (8, 1024, 8, 3),
    (16, 256, 4, 4), (16, 512, 8, 3), (16, 512, 8, 4), (32, 256, 8, 3))]
MMA_TILES = [GemvTile(n, k, w, s) for n, k, w, s in (
    (16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 6), (16, 512, 4, 3), (32, 128, 4, 6), (32, 256, 4, 3),
    (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 4, 3), (64, 128, 8, 6), (16, 512, 4, 4), (16, 128, 4, 8))]


def bench_gemv(copy_gbs: float, rows_list: list[int], tiles: list[GemvTile], mma_tiles: list[GemvTile]) -> None:
    """Per projection and rows of x: cuBLAS (bf16) against the few-row FMA kernel (gemv) and,
    from M = 2, the tensor-core one (few_row_mma), each with its chosen tile and the best of a
    few others, with bf16 and, for the draft's projections, FP8 weights; weight bytes per second
    and the ratio to the copy rate."""

    def rate(seconds: float, nbytes: int) -> str:
        return f"{nbytes / seconds / 1e9:6.0f} GB/s ({nbytes / seconds / 1e9 / copy_gbs:4.0%})"

    print("\n## few-row matmul: GB/s of weight bytes (ratio to copy rate); fp8 = FP8 weights")
    shapes = {**PROJECTIONS, **DRAFT_PROJECTIONS}
    for name, (n, k) in shapes.items():
        for fp8 in (False, True) if name in DRAFT_PROJECTIONS else (False,):
            itemsize = 1 if fp8 else 2
            copies = max(2, -(-2 * L2_BYTES // (n * k * itemsize)))
            dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
            quantized = [fp8_rows(w) for w in dense] if fp8 else []
            weights = [w for w, _ in quantized] if fp8 else dense
            scale = quantized[0][1] if fp8 else None  # every copy's scales are close; one serves all
            nbytes = copies * n * k * itemsize
            for m in rows_list:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                ref = F.linear(x.float(), weights[0].float() * (1 if scale is None else scale[:, None]))
                cublas = graph_time(lambda d=dense: [F.linear(x, w) for w in d])
                line = f"{name:<14}{' fp8' if fp8 else '    '} M={m}  cublas bf16 {rate(cublas, copies * n * k * 2)}"
                kernels = []
                if m <= MAX_ROWS:
                    kernels.append(("fma", gemv, [gemv_tile(n, k, m, fp8), *(tiles if m == 1 else ROW_TILES)]))
                if m > 1:
                    kernels.append(("mma", few_row_mma, [few_row_mma_tile(n, k), *mma_tiles]))
                for label, kernel, candidates in kernels:
                    results = {}
                    for tile in candidates:
                        key = f"n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages}"
                        err = (kernel(x, weights[0], tile=tile, weight_scale=scale).float() - ref).abs().max().item()
                        if err > 2e-2 * ref.abs().max().item():
                            print(f"  {name} M={m} {label} {key}: WRONG (max error {err:.3g})")
                            continue
                        results.setdefault(key, graph_time(
                            lambda t=tile, ws=weights, f=kernel: [f(x, w, tile=t, weight_scale=scale) for w in ws]))
                    chosen = next(iter(results.values()))
                    best = min((v, key) for key, v in results.items())
                    line += (f" | {label} {rate(chosen, nbytes)} {chosen / cublas:5.2f}x"
                             f" best {rate(best[0], nbytes)} [{best[1]}]")
                print(line, flush=True)
            dense.clear()
            weights.clear()
            quantized.clear()
            torch.cuda.empty_cache()


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for key, family in (("gemv", "gemv (triton)"), ("paged_attention", "attention"), ("merge", "attention merge"),
                        ("rms", "rmsnorm"), ("rotary", "rotary"), ("silu", "silu_mul"), ("kv_cache", "kv write"),
                        ("write_kv", "kv write"), ("gemm", "matmul (cublas)"), ("sm90", "matmul (cublas)"),
                        ("cutlass", "matmul (cublas)"), ("nvjet", "matmul (cublas)"), ("embedding", "embedding"),
                        ("index", "embedding")):
        if key in lowered:
            return family
    return name[:60]


def profile_replay(replay: Callable[[], None], label: str, iters: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    wall = replay_seconds(replay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    families: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            family = kernel_family(event.key)
            families[family] += event.self_device_time_total / iters
            counts[family] += event.count
    if not families:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))
        return
    total = sum(families.values())
    print(f"\n## {label}: replay {wall * 1e3:.3f} ms wall, kernels {total / 1e3:.3f} ms "
          f"({sum(counts.values()) // iters} launches), gaps {wall * 1e3 - total / 1e3:.3f} ms")
    for family, us in sorted(families.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {family:<40} {us:9.1f} us  {us / total:5.1%}  x{counts[family] // iters}")


def bench_kernels(config_dir: str, copy_gbs: float) -> None:
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=36 * 1024, max_num_seqs=4)
    for kv_dtype, context in (("auto", 128), ("fp8", 32768)):
        llm = LLM(config_dir, kv_cache_bytes=8 << 30, kv_cache_dtype=kv_dtype, **common)
        runner = llm.engine.runner
        graphs = runner.graphs[0]
        bucket = (1, graphs.contexts[bisect.bisect_left(graphs.contexts, context)])
        graphs.seq_lens[:1].fill_(context)
        blocks = -(-context // runner.block_size)
        graphs.block_tables[0, :blocks] = torch.arange(blocks, dtype=torch.int32, device="cuda")
        graphs.slot_mapping[:1].fill_(context - 1)
        replay = graphs.graphs[bucket].replay
        profile_replay(replay, f"decode graph bs=1, context {context}, KV {kv_dtype}, bucket {bucket}")
        rate = decode_rate(llm, context if context <= 128 else context - 256, 64)
        bare = 1 / replay_seconds(replay)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_bytes = context * bytes_per_block(runner.model.cache_specs()) / runner.block_size
        print(f"  engine {rate:.1f} tok/s vs bare replay {bare:.1f} tok/s ({rate / bare:.1%});"
              f" roofline {copy_gbs * 1e9 / (weights + kv_bytes):.1f} tok/s")
        del llm, runner, graphs
        torch.cuda.empty_cache()


def routes_engine(config_dir: str, cublas_rows: bool) -> LLM:
    """An engine with the tensor-core kernel for 2-16 rows, or (cublas_rows) one captured with
    that kernel declared unsuitable for every shape, so those rows go to cuBLAS."""
    import tokenmill.kernels.few_row_mma as mma

    suits = mma.few_row_mma_suits
    if cublas_rows:
        mma.few_row_mma_suits = lambda n, k: False
    try:
        return LLM(config_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                   kv_cache_bytes=4 << 30)
    finally:
        mma.few_row_mma_suits = suits


def bench_routes(config_dir: str, rounds: int = 5) -> None:
    """Decode-step replay at a few batch sizes: the engine against one captured with 2-16 rows on
    cuBLAS, the route the tensor-core kernel replaced. Both engines are alive at once and their
    replays interleaved, round after round (medians), so clock drift falls on both alike; batch 1
    runs the same kernels in both, so its ratio is the measurement's own bias."""
    batches, context = (1, 2, 4, 8, 16), 512
    variants = ("engine", "cuBLAS for 2-16 rows")
    replays: dict[tuple[str, int], Callable[[], float]] = {}
    engines = []
    for variant in variants:
        llm = routes_engine(config_dir, cublas_rows=variant != "engine")
        engines.append(llm)
        runner = llm.engine.runner
        blocks = context // runner.block_size
        for batch in batches:
            replays[variant, batch] = functools.partial(
                replay_batch, runner.graphs[0], batch, context, blocks, runner.block_size)
    samples: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        for key, replay in replays.items():
            samples[key].append(replay())
    print(f"\n## decode step replay, context {context}: the engine against 2-16 rows on cuBLAS "
          f"(median of {rounds} interleaved rounds)")
    for batch in batches:
        engine = statistics.median(samples["engine", batch])
        others = "  ".join(f"{v}: {statistics.median(samples[v, batch]) * 1e3:6.3f} ms "
                           f"({engine / statistics.median(samples[v, batch]):5.3f}x)" for v in variants[1:])
        print(f"  bs={batch:<3} engine {engine * 1e3:6.3f} ms | {others}")
    del engines
    torch.cuda.empty_cache()


def replay_batch(graphs: StepGraphs, batch: int, context: int, blocks: int, block_size: int) -> float:
    """Seconds per replay of the decode graph of `batch` requests, each `context` tokens long."""
    graphs.seq_lens[:batch].fill_(context)
    for row in range(batch):
        graphs.block_tables[row, :blocks] = torch.arange(row * blocks, (row + 1) * blocks, device="cuda")
    last = graphs.block_tables[:batch, blocks - 1].long() * block_size
    graphs.slot_mapping[:batch] = last + (context - 1) % block_size
    bucket = (batch, graphs.contexts[bisect.bisect_left(graphs.contexts, context)])
    return replay_seconds(graphs.graphs[bucket].replay)


def spec_phases() -> list[tuple[object, str]]:
    """(owner, attribute) of the host phases of a speculative step, labelled in the profile."""
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.runner.model_runner import ModelRunner
    from tokenmill.sample import draft_verification as target_step
    from tokenmill.sample import sampler
    from tokenmill.speculative import draft_model, draft_sampling

    return [(LLMEngine, "_propose"), (LLMEngine, "_resolve"), (LLMEngine, "_append_tokens"), (Scheduler, "schedule"),
            (ModelRunner, "prepare_inputs"), (ModelRunner, "_logits"), (ModelRunner, "_copy_to_host"),
            (target_step, "verify_drafts"), (ModelRunner, "execute"), (sampler.Sampler, "forward"),
            (draft_model.DraftModelProposer, "_catch_up"),
            (draft_model.DraftModelProposer, "_decode"), (draft_model.DraftModelProposer, "_reserve"),
            (draft_model, "_DecodeSteps"), (sampler.SamplingMetadata, "build"), (draft_sampling, "processed_probs")]


def labelled(owner: object, name: str) -> None:
    original = getattr(owner, name)
    is_static = isinstance(vars(owner).get(name), (classmethod, staticmethod)) if isinstance(owner, type) else False

    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"phase:{name}"):
            return original(*args, **kwargs)

    setattr(owner, name, classmethod(lambda cls, *a, **k: wrapper(*a, **k)) if is_static else wrapper)


def idle_profile(llm: LLM, label: str, new_tokens: int = 64) -> None:
    """Where the GPU idles while `llm` decodes one request, attributed to the host phase running then."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = list(range(1000, 1128))
    llm.generate([prompt[::-1]], params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt[1:]], params)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    phases = [(e.time_range.start, e.time_range.end, e.name[6:]) for e in events if e.name.startswith("phase:")]
    busy, gaps = 0.0, collections.defaultdict(float)
    end = kernels[0][0]
    for start, stop in kernels:
        if start > end:
            covering = [p for p in phases if p[0] <= (start + end) / 2 <= p[1]]
            phase = min(covering, key=lambda p: p[1] - p[0])[2] if covering else "(no phase)"
            gaps[phase] += start - end
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    window = end - kernels[0][0]
    stats = llm.engine.spec_stats
    steps = new_tokens / (stats.mean_acceptance_length if stats.num_drafts else 1)
    print(f"\n## {label}, {new_tokens} tokens: GPU window {window / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle "
          f"{(window - busy) / 1e3:.1f} ms over ~{steps:.0f} steps ({(window - busy) / steps / 1e3:.3f} ms per step)")
    for phase, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  idle while {phase:<28} {us / steps:8.1f} us per step")
    families: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            families[kernel_family(event.key)] += event.self_device_time_total
            counts[kernel_family(event.key)] += event.count
    print(f"  device busy {busy / steps / 1e3:.3f} ms and {sum(counts.values()) / steps:.0f} launches per step")
    for family, us in sorted(families.items(), key=lambda kv: -kv[1])[:24]:
        print(f"  device {family:<44} {us / steps:8.1f} us per step  x{counts[family] / steps:.1f}")


def bench_idle(target_dir: str, draft_dir: str) -> None:
    from spec_bench import draft_spec

    for owner, name in spec_phases():
        labelled(owner, name)
    common = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096, kv_cache_bytes=8 << 30, max_num_seqs=4)
    llm = LLM(target_dir, **common)
    idle_profile(llm, "plain decode bs=1")
    del llm
    # The target as spec_bench measures it: a fixed acceptance length of 3.5, gamma 3,
    # the FP8 draft with a 32k draft vocabulary.
    vocab_file = Path(target_dir).parent / "draft_vocab.npy"
    numpy.save(vocab_file, numpy.arange(32768, dtype=numpy.int64))
    llm = LLM(target_dir, **common, **draft_spec(Path(draft_dir), 3, vocab_file, "fp8", 3.5))
    idle_profile(llm, "spec at fixed acceptance length 3.5, bs=1, 1B-shape FP8 draft, 32k draft vocabulary, gamma 3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: gemv, routes, kernels, spec")
    parser.add_argument("--gemv-rows", default="1,2,5,8", help="rows of x in the gemv part")
    parser.add_argument("--gemv-sweep", action="store_true", help="also try other one-row and tensor-core tiles")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    if "gemv" not in skip:
        rows = [int(r) for r in args.gemv_rows.split(",")]
        bench_gemv(copy_gbs, rows, TILES if args.gemv_sweep else [], MMA_TILES if args.gemv_sweep else [])
    with tempfile.TemporaryDirectory() as tmp:
        from spec_bench import LLAMA_32_1B

        target_dir, draft_dir = Path(tmp, "target"), Path(tmp, "draft")
        for path, config in ((target_dir, LLAMA_31_8B), (draft_dir, LLAMA_32_1B)):
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
        if "routes" not in skip:
            bench_routes(str(target_dir))
        if "kernels" not in skip:
            bench_kernels(str(target_dir), copy_gbs)
        if "spec" not in skip:
            bench_idle(str(target_dir), str(draft_dir))


if __name__ == "__main__":
    main()

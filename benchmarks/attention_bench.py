"""Triton attention and fused-op kernels on one GPU, beside the ceilings measured in the same run.

    python benchmarks/attention_bench.py [--no-sweep] [--compile-peers] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/attention_bench.py --smoke   # tiny, on CPU: checks the script

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head size 128, 16-token blocks whose
order is shuffled as in a long-running pool). Decode: one query token per request at batch
1/16/64 x context 128/4k/32k, bf16 and FP8 KV; GB/s counts the KV bytes read, and its ratio is
to the device-to-device copy rate (bytes read + written). Prefill: 2048 tokens cold and after
8k of context; TFLOP/s counts causal QK and PV, and its ratio is to a bf16 8192^3 matmul.
Also: the KV write, and RMSNorm+residual / SiLU-and-mul / rotary against eager PyTorch.
The sweep times other tile shapes and split counts on a few shapes, to tune the heuristics.

Every GPU time is a CUDA-graph replay after an L2 flush, median of the repeats (launch overhead
is excluded, as in the engine's captured decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from an uninstalled checkout

from gpu_bench import copy_seconds  # noqa: E402

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.attention import AttentionPlan, paged_attention, plan_attention
from tokenmill.kernels.kv_cache import write_kv_cache
from tokenmill.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from tokenmill.kernels.rotary import apply_rotary_, apply_rotary_ref

PAGE = 16
FP8 = torch.float8_e4m3fn
KV_DTYPES = ((torch.bfloat16, "bf16"), (FP8, "fp8"))
rows: list[dict] = []


@dataclass(frozen=True)
class Setup:
    device: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: int  # query tokens of the prefill cases
    depth: int  # context before the second prefill case
    big: int  # side of the matmul ceiling
    repeats: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


FULL = Setup("cuda", 32, 8, 128, 4096, 14336, (1, 16, 64), (128, 4096, 32768), 2048, 8192, 8192, 30)
SMOKE = Setup("cpu", 4, 2, 64, 64, 96, (1, 3), (16, 40), 24, 16, 128, 1)


def timer(s: Setup) -> Callable[[Callable[[], object]], float]:
    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    def gpu_time(fn: Callable[[], object]) -> float:
        """Median seconds of one graph replay of fn, each after flushing L2."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()  # compile and warm outside the capture
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(s.repeats)]
        for start, end in pairs:
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3

    return gpu_time if s.device == "cuda" else cpu_time


def record(group: str, name: str, seconds: float, nbytes: float = 0, flops: float = 0, **extra: object) -> dict:
    row = {"group": group, "name": name, "us": seconds * 1e6, "GB/s": nbytes / seconds / 1e9,
           "TFLOP/s": flops / seconds / 1e12, **extra}
    rows.append(row)
    return row


class Bench:
    def __init__(self, s: Setup) -> None:
        self.s = s
        self.time = timer(s)
        self.copy_gbs = self.matmul_tflops = 1.0
        self.num_blocks = max(s.batches) * -(-max(s.contexts) // PAGE)
        shape = (2, self.num_blocks, PAGE, s.kv_heads, s.head_dim)
        bf16 = torch.empty(shape, dtype=torch.bfloat16, device=s.device).normal_()
        self.caches = {torch.bfloat16: bf16, FP8: bf16.to(FP8)}
        self.perm = torch.randperm(self.num_blocks, device=s.device, dtype=torch.int32)

    def ceilings(self) -> None:
        s = self.s
        src = torch.empty(1 << 30 if s.device == "cuda" else 1 << 20, dtype=torch.uint8, device=s.device)
        dst = torch.empty_like(src)
        seconds = copy_seconds(self.time, dst, src)
        self.copy_gbs = record("ceiling", "copy (read + write)", seconds, 2 * src.numel())["GB/s"]
        a = torch.randn(s.big, s.big, dtype=torch.bfloat16, device=s.device)
        seconds = self.time(lambda: a @ a)
        self.matmul_tflops = record("ceiling", f"bf16 matmul {s.big}^3", seconds, flops=2 * s.big**3)["TFLOP/s"]

    def inputs(self, query_lens: list[int], seq_lens: list[int]):
        s = self.s
        blocks = [-(-n // PAGE) for n in seq_lens]
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=s.device)
        used = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = self.perm[used : used + n]
            used += n
        assert used <= self.num_blocks
        starts = torch.tensor([0] + query_lens, device=s.device).cumsum(0).to(torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=s.device)
        q = torch.randn(sum(query_lens), s.heads, s.head_dim, dtype=torch.bfloat16, device=s.device)
        return q, starts, lens, tables

    def plan(self, query_lens: list[int], seq_lens: list[int], **overrides: object) -> AttentionPlan:
        s = self.s
        plan = plan_attention(
            num_tokens=sum(query_lens), num_requests=len(seq_lens), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
            device=torch.device(s.device), num_splits=overrides.pop("num_splits", None),
            kv_dtype=overrides.pop("kv_dtype", torch.bfloat16),
        )
        if "block_n" in overrides:  # keep the fewest keys per split, whatever the tile
            overrides["min_split_tiles"] = max(1, plan.min_split_tiles * plan.block_n // overrides["block_n"])
        if "block_m" in overrides:  # a prefill row count implies its query tokens per tile
            overrides["block_q"] = overrides["block_m"] // s.group
            overrides["num_tiles"] = sum(query_lens) // overrides["block_q"] + len(seq_lens)
        return dataclasses.replace(plan, **overrides)

    def attention(self, kv_dtype: torch.dtype, query_lens: list[int], seq_lens: list[int], plan: AttentionPlan,
                  inputs=None) -> float:
        q, starts, lens, tables = inputs or self.inputs(query_lens, seq_lens)
        cache, out = self.caches[kv_dtype], torch.empty_like(q)
        scale = self.s.head_dim**-0.5
        return self.time(lambda: paged_attention(q, cache[0], cache[1], starts, lens, tables, scale, plan, 0.7, 1.3, out=out))

    def kv_bytes(self, seq_lens: list[int], kv_dtype: torch.dtype) -> int:
        return sum(seq_lens) * self.s.kv_heads * self.s.head_dim * 2 * kv_dtype.itemsize

    def flops(self, query_lens: list[int], seq_lens: list[int]) -> int:
        pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, seq_lens))
        return 4 * self.s.heads * self.s.head_dim * pairs

    def decode(self) -> None:
        for kv_dtype, kv_name in KV_DTYPES:
            for batch in self.s.batches:
                for ctx in self.s.contexts:
                    qlens, slens = [1] * batch, [ctx] * batch
                    plan = self.plan(qlens, slens, kv_dtype=kv_dtype)
                    row = record("decode", f"{kv_name} b{batch} ctx{ctx}", self.attention(kv_dtype, qlens, slens, plan),
                                 self.kv_bytes(slens, kv_dtype), self.flops(qlens, slens), plan=label(plan))
                    row["ratio"] = row["GB/s"] / self.copy_gbs

    def prefill(self) -> None:
        s = self.s
        for kv_dtype, kv_name in KV_DTYPES:
            for depth in (0, s.depth):
                qlens, slens = [s.prefill], [s.prefill + depth]
                plan = self.plan(qlens, slens, kv_dtype=kv_dtype)
                row = record("prefill", f"{kv_name} {s.prefill} @ d{depth}", self.attention(kv_dtype, qlens, slens, plan),
                             self.kv_bytes(slens, kv_dtype), self.flops(qlens, slens), plan=label(plan))
                row["ratio"] = row["TFLOP/s"] / self.matmul_tflops
        q = torch.randn(1, s.heads, s.prefill, s.head_dim, dtype=torch.bfloat16, device=s.device)
        k = torch.randn(1, s.kv_heads, s.prefill, s.head_dim, dtype=torch.bfloat16, device=s.device)
        seconds = self.time(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
        row = record("prefill", f"peer: torch SDPA, contiguous {s.prefill}", seconds,
                     flops=self.flops([s.prefill], [s.prefill]))
        row["ratio"] = row["TFLOP/s"] / self.matmul_tflops

    def kv_write(self) -> None:
        s = self.s
        for kv_dtype, kv_name in KV_DTYPES:
            for tokens in (max(s.batches), s.prefill):
                kv = torch.randn(tokens, 2 * s.kv_heads, s.head_dim, dtype=torch.bfloat16, device=s.device)
                k, v = kv.split(s.kv_heads, dim=1)
                offsets = torch.arange(tokens, device=s.device)
                slots = self.perm[(offsets // PAGE) % self.num_blocks].long() * PAGE + offsets % PAGE
                cache = self.caches[kv_dtype]
                nbytes = tokens * 2 * s.kv_heads * s.head_dim * (2 + kv_dtype.itemsize)
                seconds = self.time(lambda: write_kv_cache(k, v, cache, slots, 0.7, 1.3))
                row = record("kv write", f"{kv_name} {tokens} tokens", seconds, nbytes)
                row["ratio"] = row["GB/s"] / self.copy_gbs

    def fused(self, compile_peers: bool) -> None:
        s = self.s
        cos = torch.randn(131072, s.head_dim, device=s.device)
        sin = torch.randn(131072, s.head_dim, device=s.device)
        for tokens in (max(s.batches), s.prefill):
            x = torch.randn(tokens, s.hidden, dtype=torch.bfloat16, device=s.device)
            res, w = torch.randn_like(x), torch.randn(s.hidden, dtype=torch.bfloat16, device=s.device)
            gate_up = torch.randn(tokens, 2 * s.inter, dtype=torch.bfloat16, device=s.device)
            qkv = torch.randn(tokens, s.heads + 2 * s.kv_heads, s.head_dim, dtype=torch.bfloat16, device=s.device)
            q, k = qkv[:, : s.heads], qkv[:, s.heads : s.heads + s.kv_heads]
            pos = torch.randint(0, 131072, (tokens,), device=s.device)
            cases = [
                ("rmsnorm+residual", tokens * s.hidden * 2 * 4, lambda: fused_add_rms_norm(x, res, w, 1e-5),
                 lambda: fused_add_rms_norm_ref(x, res, w, 1e-5)),
                ("silu_and_mul", tokens * s.inter * 2 * 3, lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up)),
                ("rotary", tokens * (s.heads + s.kv_heads) * s.head_dim * 2 * 2,
                 lambda: apply_rotary_(pos, q, k, cos, sin), lambda: apply_rotary_ref(pos, q, k, cos, sin)),
            ]
            for name, nbytes, ours, ref in cases:
                row = record("fused", f"{name} T={tokens}", self.time(ours), nbytes, eager_us=self.time(ref) * 1e6)
                row["ratio"] = row["GB/s"] / self.copy_gbs
                if compile_peers:
                    row["compiled_us"] = self.time(torch.compile(ref)) * 1e6

    def sweep(self) -> None:
        s = self.s
        tiles = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in
                 ((32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (128, 8, 3), (64, 8, 3))]
        for kv_dtype, kv_name in KV_DTYPES:
            for batch, ctx in ((1, max(s.contexts)), (max(s.batches), s.contexts[-2])):
                qlens, slens = [1] * batch, [ctx] * batch
                inputs = self.inputs(qlens, slens)
                splits = (8, 16, 32, 64) if batch == 1 else (1, 4)
                for overrides in tiles + [dict(num_splits=n) for n in splits]:
                    plan = self.plan(qlens, slens, **overrides)
                    seconds = self.attention(kv_dtype, qlens, slens, plan, inputs)
                    row = record("sweep decode", f"{kv_name} b{batch} ctx{ctx}", seconds, self.kv_bytes(slens, kv_dtype),
                                 plan=label(plan))
                    row["ratio"] = row["GB/s"] / self.copy_gbs
        # Long-context FP8 decode at batch 1: wider KV tiles against split counts.
        qlens, slens = [1], [max(s.contexts)]
        inputs = self.inputs(qlens, slens)
        for n, w, st, splits in ((n, w, st, x) for n in (128, 256) for w in (4, 8) for st in (2, 3) for x in (16, 32, 64)):
            plan = self.plan(qlens, slens, block_n=n, num_warps=w, num_stages=st, num_splits=splits)
            row = record("sweep fp8 long", f"fp8 b1 ctx{slens[0]}", self.attention(FP8, qlens, slens, plan, inputs),
                         self.kv_bytes(slens, FP8), plan=label(plan))
            row["ratio"] = row["GB/s"] / self.copy_gbs
        qlens, slens = [s.prefill], [s.prefill]
        inputs = self.inputs(qlens, slens)
        for m, n, w, st in ((128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)):
            plan = self.plan(qlens, slens, block_m=m, block_n=n, num_warps=w, num_stages=st)
            row = record("sweep prefill", f"bf16 {s.prefill}", self.attention(torch.bfloat16, qlens, slens, plan, inputs),
                         flops=self.flops(qlens, slens), plan=label(plan))
            row["ratio"] = row["TFLOP/s"] / self.matmul_tflops


def sweep_short(bench: Bench) -> None:
    """Batch-1 decode at the short contexts of a tg128 run (128-256 keys, bf16 and FP8): tiles and
    splits, where a step is a chain of memory round trips rather than a stream."""
    for kv_dtype, kv_name in KV_DTYPES:
        for ctx in (136, 248) if bench.s.device == "cuda" else bench.s.contexts:
            qlens, slens = [1], [ctx]
            inputs = bench.inputs(qlens, slens)
            configs = [dict(block_n=n, num_warps=w, num_stages=st, num_splits=1)
                       for n in (32, 64, 128) for w in (2, 4) for st in (1, 2, 3)]
            configs += [dict(block_n=n, num_splits=x) for n in (32, 64) for x in (2, 4)]
            for overrides in configs:
                plan = bench.plan(qlens, slens, kv_dtype=kv_dtype, **overrides)
                if plan.split:  # each split's fewest keys: what the sweep sets, not the 256-key default
                    plan = dataclasses.replace(plan, min_split_tiles=1)
                seconds = bench.attention(kv_dtype, qlens, slens, plan, inputs)
                row = record("sweep short decode", f"{kv_name} b1 ctx{ctx}", seconds, bench.kv_bytes(slens, kv_dtype),
                             plan=label(plan))
                row["ratio"] = row["GB/s"] / bench.copy_gbs


DEEP_CHUNKS = ((770, 260_000), (512, 260_000), (1700, 100_000), (2048, 100_000), (2048, 32768), (8192, 32768))
# Tile shapes tried on pp2048 at 100k depth: (rows, keys, warps, stages).
DEEP_TILES = ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
              (256, 64, 8, 2), (256, 64, 8, 3), (128, 32, 4, 4))


def sweep_deep_prefill(bench: Bench) -> None:
    """Prompt chunks at depth (the chunk sizes the scheduler's step-cost rule picks for the 8B shape,
    and pp2048's): the default plan (its split rule for a deep chunk whose grid fills the machine)
    against forced split counts along the keys; on pp2048 at 100k, tile shapes too, and torch's
    SDPA over the same keys laid out contiguously (a FlashAttention-class peer)."""
    s = bench.s
    on_gpu = s.device == "cuda"
    chunks = DEEP_CHUNKS if on_gpu else ((24, 40),)
    tiled = (2048, 100_000) if on_gpu else (24, 40)
    for kv_dtype, kv_name in KV_DTYPES:
        for chunk, depth in chunks:
            qlens, slens = [chunk], [chunk + depth]
            inputs = bench.inputs(qlens, slens)
            variants: list[dict] = [{}] + [{"num_splits": n} for n in (1, 2, 3, 4, 6, 8)]
            if on_gpu:  # the tiles every chunk took before the deep tiles (DEEP_TILES in kernels/attention.py)
                variants += [dict(block_m=128, block_n=64, num_warps=8, num_stages=3, num_splits=n) for n in (1, 4, 8)]
            if (chunk, depth) == tiled:
                variants += [dict(block_m=m, block_n=n, num_warps=w, num_stages=st, num_splits=1)
                             for m, n, w, st in (DEEP_TILES if on_gpu else ((32, 16, 4, 2),))]
            for overrides in variants:
                plan = bench.plan(qlens, slens, kv_dtype=kv_dtype, **overrides)
                row = record("sweep deep prefill", f"{kv_name} {chunk} @ d{depth}", bench.attention(kv_dtype, qlens, slens,
                             plan, inputs), flops=bench.flops(qlens, slens),
                             plan=label(plan) + (" (default)" if not overrides else ""))
                row["ratio"] = row["TFLOP/s"] / bench.matmul_tflops
    chunk, depth = tiled
    q = torch.randn(1, s.heads, chunk, s.head_dim, dtype=torch.bfloat16, device=s.device)
    k = torch.randn(1, s.kv_heads, chunk + depth, s.head_dim, dtype=torch.bfloat16, device=s.device)
    # Every query sees every key: (chunk * depth + chunk^2) pairs, against the causal chunk's
    # (chunk * depth + chunk^2 / 2); the figure counts the pairs SDPA computes.
    seconds = bench.time(lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True))
    row = record("sweep deep prefill", f"peer: torch SDPA, contiguous {chunk} x {chunk + depth} keys", seconds,
                 flops=4 * s.heads * s.head_dim * chunk * (chunk + depth))
    row["ratio"] = row["TFLOP/s"] / bench.matmul_tflops


def label(plan: AttentionPlan) -> str:
    return f"m{plan.block_m} n{plan.block_n} w{plan.num_warps} s{plan.num_stages} x{plan.num_splits}"


def print_table() -> None:
    print("\n| group | case | µs | GB/s | TFLOP/s | ratio | plan / peer |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        note = r.get("plan", "")
        if "eager_us" in r:
            note = f"eager {r['eager_us']:.1f} µs" + (f", compiled {r['compiled_us']:.1f} µs" if "compiled_us" in r else "")
        ratio = f"{r['ratio']:.0%}" if "ratio" in r else ""
        print(f"| {r['group']} | {r['name']} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['TFLOP/s']:.1f} | {ratio} | {note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-shape and split sweep")
    parser.add_argument("--compile-peers", action="store_true", help="also time torch.compile of the fused-op references")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run with TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--short-sweep", action="store_true", help="only the batch-1 short-context decode sweep")
    parser.add_argument("--deep-prefill-sweep", action="store_true",
                        help="only prompt chunks at 32k-260k depth: the default plan against forced key splits")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.manual_seed(0)
    s = SMOKE if args.smoke else FULL
    if s.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bench = Bench(s)
    bench.ceilings()
    if args.short_sweep:
        sweep_short(bench)
    elif args.deep_prefill_sweep:
        sweep_deep_prefill(bench)
    else:
        for stage in (bench.decode, bench.prefill, bench.kv_write, lambda: bench.fused(args.compile_peers)):
            stage()
        if not args.no_sweep:
            bench.sweep()
    print(f"copy {bench.copy_gbs:.0f} GB/s, bf16 matmul {bench.matmul_tflops:.0f} TFLOP/s, "
          f"{time.perf_counter() - began:.0f} s")
    print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": bench.copy_gbs, "matmul_TFLOPs": bench.matmul_tflops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

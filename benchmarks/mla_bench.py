"""MLA kernels on one GPU (DeepSeek-V2-Lite attention shape), beside ceilings measured in the same run.

    python benchmarks/mla_bench.py [--no-sweep] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/mla_bench.py --smoke   # tiny, on CPU: checks the script

Shape: 16 heads, latent 512 + rope 64 (576 values per token), q/k head 192, v head 128, hidden
2048, 64-token blocks in shuffled order. First every kernel is checked against its PyTorch
reference at these shapes. Then:
- absorbed decode (one query token per request) at batch 1 and 16, contexts 4k and 32k, bf16 and
  FP8 latent cache: GB/s counts the latent bytes read, its ratio is to the device-to-device copy
  rate (bytes read + written) measured here (target >= 80% at 32k);
- verification: 1 + 4 query tokens per request against a one-token decode at batch 1 (target <= 1.15x);
- prefill chunks through the layer's absorbed path and its up-projected path (gather, kv_b_proj
  and the prefill kernel): 2048 tokens cold and after 8k of context, and 64 / 256 tokens after 8k,
  where the rule (absorbed up to ABSORBED_MAX_QUERY_LEN query tokens) is checked; TFLOP/s counts
  the attention's own QK and PV work, the ratio is to a bf16 8192^3 matmul;
- the sweep times other tile shapes and split counts on the decode and verification cases.
Every GPU time is a CUDA-graph replay after an L2 flush, median of the repeats.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from an uninstalled checkout

from gpu_bench import copy_seconds  # noqa: E402
from transformers import DeepseekV2Config  # noqa: E402

from tokenmill.kernels.mla_decode import AbsorbedPlan, absorbed_attention, plan_absorbed  # noqa: E402
from tokenmill.kernels.mla_prefill import upprojected_attention  # noqa: E402
from tokenmill.layers.attention.backend import AttentionMetadata  # noqa: E402
from tokenmill.layers.attention.mla import ABSORBED_MAX_QUERY_LEN, MLAAttention  # noqa: E402
from tokenmill.layers.attention.mla_backends import TritonMLABackend  # noqa: E402
from tokenmill.layers.attention.mla_ref import (  # noqa: E402
    absorbed_attention_ref,
    quantize_latent_ref,
    upprojected_attention_ref,
)

FP8 = torch.float8_e4m3fn
CACHE_DTYPES = ((torch.bfloat16, "bf16"), (FP8, "fp8"))
GAMMA = 4
rows: list[dict] = []


@dataclass(frozen=True)
class Setup:
    device: str
    heads: int
    latent: int
    rope: int
    nope: int
    vdim: int
    hidden: int
    page: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: int
    depth: int  # context before the later prefill cases
    chunks: tuple[int, ...]  # shorter prefill chunks after `depth` of context: where the paths cross
    big: int  # side of the matmul ceiling
    repeats: int

    @property
    def width(self) -> int:
        return self.latent + self.rope


FULL = Setup("cuda", 16, 512, 64, 128, 128, 2048, 64, (1, 16), (4096, 32768), 2048, 8192, (64, 256), 8192, 30)
SMOKE = Setup("cpu", 4, 32, 8, 16, 16, 64, 4, (1, 3), (24, 40), 24, 16, (6, 12), 128, 1)


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


def label(plan: AbsorbedPlan) -> str:
    return f"h{plan.block_h} q{plan.block_q} n{plan.block_n} w{plan.num_warps} s{plan.num_stages} x{plan.num_splits}"


class Bench:
    def __init__(self, s: Setup) -> None:
        self.s = s
        self.time = timer(s)
        self.copy_gbs = self.matmul_tflops = 1.0
        self.num_blocks = max(s.batches) * -(-(max(s.contexts) + s.depth + s.prefill) // s.page)
        bf16 = torch.randn(self.num_blocks, s.page, s.width, device=s.device).to(torch.bfloat16)
        self.caches = {torch.bfloat16: bf16, FP8: quantize_latent_ref(bf16, 0.05)}
        self.perm = torch.randperm(self.num_blocks).tolist()

    def ceilings(self) -> None:
        s = self.s
        src = torch.empty(1 << 30 if s.device == "cuda" else 1 << 20, dtype=torch.uint8, device=s.device)
        dst = torch.empty_like(src)
        self.copy_gbs = record("ceiling", "copy (read + write)", copy_seconds(self.time, dst, src), 2 * src.numel())["GB/s"]
        a = torch.randn(s.big, s.big, dtype=torch.bfloat16, device=s.device)
        self.matmul_tflops = record("ceiling", f"bf16 matmul {s.big}^3", self.time(lambda: a @ a),
                                    flops=2 * s.big**3)["TFLOP/s"]

    def metadata(self, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        s = self.s
        blocks = [-(-n // s.page) for n in seq_lens]
        tables, used = [], 0
        for n in blocks:
            tables.append(self.perm[used : used + n] + [0] * (max(blocks) - n))
            used += n
        assert used <= self.num_blocks
        slots = [tables[i][p // s.page] * s.page + p % s.page
                 for i, (q, n) in enumerate(zip(query_lens, seq_lens)) for p in range(n - q, n)]
        return AttentionMetadata(
            query_start_loc=torch.tensor([0] + query_lens, device=s.device).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=s.device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=s.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=s.device),
            query_lens_host=query_lens, seq_lens_host=seq_lens,
        )

    def queries(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        q = torch.randn(num_tokens, s.heads, s.width, dtype=torch.bfloat16, device=s.device)
        return q[..., : s.latent], q[..., s.latent :]

    def plan(self, md: AttentionMetadata, cache_dtype: torch.dtype, **overrides: int) -> AbsorbedPlan:
        launch = {k: overrides.pop(k) for k in ("num_warps", "num_stages") if k in overrides}
        plan = plan_absorbed(num_tokens=sum(md.query_lens_host), num_requests=md.num_requests,
                             max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, num_heads=self.s.heads,
                             device=torch.device(self.s.device), fp8_cache=cache_dtype == FP8, **overrides)
        return dataclasses.replace(plan, **launch)

    def absorbed(self, cache_dtype: torch.dtype, md: AttentionMetadata, plan: AbsorbedPlan) -> float:
        q_latent, q_pe = self.queries(sum(md.query_lens_host))
        cache, out = self.caches[cache_dtype], torch.empty_like(q_latent)
        scale = (self.s.nope + self.s.rope) ** -0.5
        return self.time(lambda: absorbed_attention(q_latent, q_pe, cache, md.query_start_loc, md.seq_lens,
                                                    md.block_tables, scale, plan, 0.05, out=out))

    def latent_bytes(self, md: AttentionMetadata, cache_dtype: torch.dtype) -> int:
        return sum(md.seq_lens_host) * self.s.width * cache_dtype.itemsize

    def check(self) -> None:
        """Every kernel against its reference at the benchmark's shapes, before any timing."""
        s, ctx = self.s, max(self.s.contexts)
        scale = (s.nope + s.rope) ** -0.5
        cases = [([1], [ctx]), ([1] * max(s.batches), [ctx // 4 * (i % 4 + 1) for i in range(max(s.batches))]),
                 ([1 + GAMMA], [ctx]), ([s.prefill], [s.prefill])]
        for cache_dtype, name in CACHE_DTYPES:
            for qlens, slens in cases:
                md = self.metadata(qlens, slens)
                q_latent, q_pe = self.queries(sum(qlens))
                cache = self.caches[cache_dtype]
                out = absorbed_attention(q_latent, q_pe, cache, md.query_start_loc, md.seq_lens, md.block_tables,
                                         scale, self.plan(md, cache_dtype), 0.05)
                err = (out.float() - absorbed_attention_ref(q_latent.float(), q_pe.float(), cache, md, scale, 0.05)).abs().max()
                print(f"check absorbed {name} q={qlens[:2]} ctx={slens[:2]}: max abs error {err:.2e}", flush=True)
                assert err < 3e-2, "absorbed kernel differs from its reference"
        short = min(37, s.contexts[0])
        md = self.metadata([s.prefill, short], [s.prefill + s.depth, s.contexts[0]])
        q = torch.randn(s.prefill + short, s.heads, s.nope + s.rope, dtype=torch.bfloat16, device=s.device)
        kv = torch.randn(sum(md.seq_lens_host), s.heads, s.nope + s.vdim, dtype=torch.bfloat16, device=s.device)
        k_pe = torch.randn(kv.shape[0], s.rope, dtype=torch.bfloat16, device=s.device)
        starts = torch.cumsum(md.seq_lens, 0) - md.seq_lens
        out = upprojected_attention(q[..., : s.nope], q[..., s.nope :], kv[..., : s.nope], k_pe, kv[..., s.nope :],
                                    md.query_start_loc, starts, md.seq_lens, scale)
        err = (out.float() - upprojected_attention_ref(q, kv[..., : s.nope], k_pe, kv[..., s.nope :], md, scale)).abs().max()
        print(f"check up-projected prefill: max abs error {err:.2e}", flush=True)
        assert err < 3e-2, "prefill kernel differs from its reference"

    def decode(self) -> dict[tuple[str, int, int], float]:
        seconds = {}
        for cache_dtype, name in CACHE_DTYPES:
            for batch in self.s.batches:
                for ctx in self.s.contexts:
                    md = self.metadata([1] * batch, [ctx] * batch)
                    plan = self.plan(md, cache_dtype)
                    t = seconds[name, batch, ctx] = self.absorbed(cache_dtype, md, plan)
                    row = record("absorbed decode", f"{name} b{batch} ctx{ctx}", t, self.latent_bytes(md, cache_dtype),
                                 plan=label(plan))
                    row["ratio"] = row["GB/s"] / self.copy_gbs
        return seconds

    def verify(self, decode_seconds: dict[tuple[str, int, int], float]) -> None:
        for cache_dtype, name in CACHE_DTYPES:
            for ctx in self.s.contexts:
                md = self.metadata([1 + GAMMA], [ctx])
                plan = self.plan(md, cache_dtype)
                t = self.absorbed(cache_dtype, md, plan)
                row = record("verify 1+4 vs decode", f"{name} b1 ctx{ctx}", t, self.latent_bytes(md, cache_dtype),
                             plan=label(plan))
                row["ratio"] = t / decode_seconds[name, 1, ctx]
                row["ratio_is_time"] = True

    def prefill(self) -> None:
        """The layer's two paths on a prefill chunk, attention only (projections excluded)."""
        s = self.s
        config = DeepseekV2Config(hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.heads,
                                  q_lora_rank=None, kv_lora_rank=s.latent, qk_nope_head_dim=s.nope,
                                  qk_rope_head_dim=s.rope, v_head_dim=s.vdim, num_hidden_layers=1)
        with torch.device(s.device):
            layer = MLAAttention(config, "interleaved", TritonMLABackend()).to(torch.bfloat16)
        cache = self.caches[torch.bfloat16].clone()
        for chunk, depth in [(s.prefill, 0), (s.prefill, s.depth)] + [(n, s.depth) for n in s.chunks]:
            qlens, slens = [chunk], [chunk + depth]
            md = self.metadata(qlens, slens)
            x = torch.randn(chunk, s.hidden, dtype=torch.bfloat16, device=s.device) * 0.1
            q, compressed = layer.projections(x)
            layer.backend.prepare(torch.arange(depth, depth + chunk, device=s.device), q, compressed,
                                  layer.kv_a_layernorm, layer.rotary, cache, md.slot_mapping, 1.0)
            q_nope, q_pe = q.split([s.nope, s.rope], -1)
            pairs = chunk * depth + chunk * (chunk + 1) // 2
            results = {}
            for path, attend, flops in (("absorbed", layer.attend_absorbed, 2 * pairs * s.heads * (s.width + s.latent)),
                                        ("up-projected", layer.attend_upprojected,
                                         2 * pairs * s.heads * (s.nope + s.rope + s.vdim))):
                results[path] = attend(q_nope, q_pe, cache, md)
                row = record("prefill path", f"{path} {chunk} @ d{depth}",
                             self.time(lambda attend=attend: attend(q_nope, q_pe, cache, md)), flops=flops)
                row["ratio"] = row["TFLOP/s"] / self.matmul_tflops
            err = (results["absorbed"].float() - results["up-projected"].float()).abs().max().item()
            print(f"prefill {chunk} @ d{depth}: the two paths differ by {err:.2e} (max abs)", flush=True)
            assert err < 5e-2, "the absorbed and up-projected paths disagree"

    def sweep(self) -> None:
        s, ctx = self.s, max(self.s.contexts)
        for cache_dtype, name in CACHE_DTYPES:
            for batch in s.batches:
                md = self.metadata([1] * batch, [ctx] * batch)
                splits = (64, 132, 264) if batch == 1 else (8, 32)
                tiles = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in
                         ((16, 4, 3), (32, 4, 2), (32, 8, 2), (64, 8, 2), (128, 8, 2))]
                for overrides in tiles + [dict(num_splits=x) for x in splits]:
                    plan = self.plan(md, cache_dtype, **overrides)
                    row = record("sweep decode", f"{name} b{batch} ctx{ctx}", self.absorbed(cache_dtype, md, plan),
                                 self.latent_bytes(md, cache_dtype), plan=label(plan))
                    row["ratio"] = row["GB/s"] / self.copy_gbs
            md = self.metadata([1 + GAMMA], [ctx])
            for overrides in (dict(block_q=1), dict(block_q=2), dict(block_q=2, block_n=16), dict(block_q=4, block_n=16),
                              dict(block_q=8, block_h=8, block_n=16)):
                plan = self.plan(md, cache_dtype, **overrides)
                row = record("sweep verify", f"{name} b1 q{1 + GAMMA} ctx{ctx}", self.absorbed(cache_dtype, md, plan),
                             self.latent_bytes(md, cache_dtype), plan=label(plan))
                row["ratio"] = row["GB/s"] / self.copy_gbs
        self.sweep_prefill()

    def sweep_prefill(self) -> None:
        s = self.s
        md = self.metadata([s.prefill], [s.prefill])
        q = torch.randn(s.prefill, s.heads, s.nope + s.rope, dtype=torch.bfloat16, device=s.device)
        kv = torch.randn(s.prefill, s.heads, s.nope + s.vdim, dtype=torch.bfloat16, device=s.device)
        k_pe = torch.randn(s.prefill, s.rope, dtype=torch.bfloat16, device=s.device)
        starts = torch.zeros(1, dtype=torch.int64, device=s.device)
        flops = 2 * s.prefill * (s.prefill + 1) // 2 * s.heads * (s.nope + s.rope + s.vdim)
        for m, n, w in ((64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 32, 8), (64, 32, 4)):
            seconds = self.time(lambda m=m, n=n, w=w: upprojected_attention(
                q[..., : s.nope], q[..., s.nope :], kv[..., : s.nope], k_pe, kv[..., s.nope :], md.query_start_loc,
                starts, md.seq_lens, 0.1, block_m=m, block_n=n, num_warps=w))
            row = record("sweep prefill kernel", f"bf16 {s.prefill}", seconds, flops=flops, plan=f"m{m} n{n} w{w}")
            row["ratio"] = row["TFLOP/s"] / self.matmul_tflops


def print_table() -> None:
    print("\n| group | case | µs | GB/s | TFLOP/s | ratio | plan |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        ratio = ""
        if "ratio" in r:
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio_is_time") else f"{r['ratio']:.0%}"
        print(f"| {r['group']} | {r['name']} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['TFLOP/s']:.1f} | {ratio} | "
              f"{r.get('plan', '')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-shape and split sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run with TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.manual_seed(0)
    s = SMOKE if args.smoke else FULL
    if s.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bench = Bench(s)
    bench.check()
    bench.ceilings()
    bench.verify(bench.decode())
    bench.prefill()
    if not args.no_sweep:
        bench.sweep()
    expanded = s.heads * (s.nope + s.rope + s.vdim)  # per-head K and V values per token
    print(f"copy {bench.copy_gbs:.0f} GB/s, bf16 matmul {bench.matmul_tflops:.0f} TFLOP/s; absorbed path up to "
          f"{ABSORBED_MAX_QUERY_LEN} query tokens; latent cache {s.width} values per token against {expanded} expanded "
          f"({expanded / s.width:.1f}x the tokens per byte); {time.perf_counter() - began:.0f} s")
    print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": bench.copy_gbs, "matmul_TFLOPs": bench.matmul_tflops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

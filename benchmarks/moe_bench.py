"""One MoE layer of Qwen3-30B-A3B shape on one GPU, each figure beside the ceiling measured in the same run.

    python benchmarks/moe_bench.py [--sweep] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/moe_bench.py --smoke   # tiny, on CPU: checks the script

A random bf16 SparseMoeBlock (hidden 2048, 128 experts top-8 of intermediate 768, softmax router
with norm_topk_prob) runs routing + experts through the Triton kernels. Each token count is
first checked against the float32 reference on the same weights and routing, then timed as a
CUDA-graph replay after an L2 flush (median of the repeats). Decode (T = 1, 16, 64) counts the
bytes the call must read: the experts its tokens selected (counted on the device once, outside
the timed region), the router and x / out; its ratio is to the device-to-device copy rate
(bytes read + written). Prefill (T = 2048) counts the active FLOPs (router + k experts per
token); its ratio is to a bf16 8192^3 matmul. The PyTorch reference path (eager, per-expert
loop) is timed beside it. --sweep also times other tiles of both paths, to tune the heuristics.
"""

from __future__ import annotations

import argparse
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
from transformers import Qwen3MoeConfig  # noqa: E402

from tokenmill.kernels.gemv import GemvTile  # noqa: E402
from tokenmill.kernels.moe.align import align_slots  # noqa: E402
from tokenmill.kernels.moe.combine import combine  # noqa: E402
from tokenmill.kernels.moe.experts import fused_experts, uses_few_row_path  # noqa: E402
from tokenmill.kernels.moe.few_row import few_row_experts  # noqa: E402
from tokenmill.kernels.moe.grouped_gemm import GroupedTile, grouped_experts  # noqa: E402
from tokenmill.layers.moe import SparseMoeBlock, fused_experts_ref, select_experts  # noqa: E402


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: torch.dtype
    hidden: int
    inter: int
    experts: int
    top_k: int
    decode: tuple[int, ...]
    prefill: int
    big: int  # side of the matmul ceiling
    repeats: int


FULL = Setup("cuda", torch.bfloat16, 2048, 768, 128, 8, (1, 16, 64), 2048, 8192, 30)
SMOKE = Setup("cpu", torch.float32, 32, 64, 8, 2, (1, 3), 20, 64, 1)
TARGETS = {1: 0.85, 16: 0.75, 64: 0.75}  # issue 21: of the bandwidth roofline; prefill: 50% of matmul
PREFILL_TARGET = 0.50
rows: list[dict] = []


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
        return _median_events(graph.replay, s.repeats)

    return gpu_time if s.device == "cuda" else cpu_time


def _median_events(fn: Callable[[], object], repeats: int) -> float:
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3


def eager_time(s: Setup, fn: Callable[[], object]) -> float:
    """The reference path syncs with the host (it loops over the experts present): timed eagerly."""
    if s.device != "cuda":
        return timer(s)(fn)
    fn()
    return _median_events(fn, max(3, s.repeats // 5))


class Bench:
    def __init__(self, s: Setup) -> None:
        self.s = s
        self.time = timer(s)
        self.copy_gbs = self.matmul_tflops = 1.0
        config = Qwen3MoeConfig(hidden_size=s.hidden, moe_intermediate_size=s.inter, num_experts=s.experts,
                                num_experts_per_tok=s.top_k, norm_topk_prob=True)
        gen = torch.Generator(device=s.device).manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(s.dtype)
        try:
            with torch.device(s.device):
                self.block = SparseMoeBlock(config, use_triton=True).eval()
                self.reference = SparseMoeBlock(config).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        with torch.no_grad():
            for name, param in self.block.named_parameters():
                std = s.hidden**-0.5 if name == "gate.weight" else 0.02
                param.normal_(0.0, std, generator=gen)
        self.reference.load_state_dict(self.block.state_dict())
        self.expert_bytes = 3 * s.hidden * s.inter * self.block.experts.w13.element_size()
        self.router_bytes = s.experts * s.hidden * self.block.gate.weight.element_size()
        self.failures = 0

    def ceilings(self) -> None:
        s = self.s
        src = torch.empty(1 << 30 if s.device == "cuda" else 1 << 20, dtype=torch.uint8, device=s.device)
        dst = torch.empty_like(src)
        seconds = copy_seconds(self.time, dst, src)
        self.copy_gbs = record("ceiling", "copy (read + write)", seconds, 2 * src.numel())["GB/s"]
        a = torch.randn(s.big, s.big, dtype=torch.bfloat16, device=s.device)
        seconds = self.time(lambda: a @ a)
        self.matmul_tflops = record("ceiling", f"bf16 matmul {s.big}^3", seconds, flops=2 * s.big**3)["TFLOP/s"]

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=self.s.device).manual_seed(tokens)
        x = torch.randn(tokens, self.s.hidden, generator=gen, device=self.s.device, dtype=self.s.dtype)
        with torch.no_grad():
            weights, ids = select_experts(self.block.gate(x), self.block.routing, use_triton=True)
        return x, weights, ids

    def check(self, tokens: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> str:
        """The fused layer against the float32 reference on the same weights and routing."""
        with torch.no_grad():
            actual = self.block(x).float()
            experts = self.block.experts
            expected = fused_experts_ref(x.float(), experts.w13.float(), experts.w2.float(), weights, ids)
        error = (actual - expected).abs().max().item() / expected.abs().max().item()
        ok = error <= 2e-2
        self.failures += not ok
        return f"{'ok' if ok else 'MISMATCH'} {error:.1e}"

    def layer(self, tokens: int, prefill: bool) -> None:
        s = self.s
        x, weights, ids = self.inputs(tokens)
        unique = torch.unique(ids).numel()
        nbytes = unique * self.expert_bytes + self.router_bytes + 2 * x.numel() * x.element_size()
        flops = 2 * tokens * (s.top_k * 3 * s.hidden * s.inter + s.hidden * s.experts)
        verdict = self.check(tokens, x, weights, ids)
        with torch.no_grad():
            seconds = self.time(lambda: self.block(x))
            reference = eager_time(s, lambda: self.reference(x))
            experts_only = self.time(lambda: fused_experts(x, self.block.experts.w13, self.block.experts.w2, weights, ids))
        path = "few-row" if uses_few_row_path(tokens) else "grouped"
        row = record("prefill" if prefill else "decode", f"T={tokens}", seconds, nbytes, flops, path=path, unique=unique,
                     check=verdict, reference_us=reference * 1e6, experts_us=experts_only * 1e6)
        row["ratio"] = row["TFLOP/s"] / self.matmul_tflops if prefill else row["GB/s"] / self.copy_gbs
        row["target"] = PREFILL_TARGET if prefill else TARGETS.get(tokens, 0.0)

    def sweep(self) -> None:
        """Experts only (routing excluded), other tiles of each path, against the defaults' rows above."""
        w13, w2 = self.block.experts.w13, self.block.experts.w2
        few = [(GemvTile(32, 128, 4, 3), GemvTile(64, 128, 4, 3)), (GemvTile(16, 128, 4, 4), GemvTile(64, 128, 4, 3)),
               (GemvTile(32, 256, 4, 2), GemvTile(64, 128, 4, 3)), (GemvTile(64, 128, 8, 3), GemvTile(64, 128, 4, 3)),
               (GemvTile(32, 128, 4, 3), GemvTile(32, 128, 4, 4)), (GemvTile(32, 128, 4, 3), GemvTile(128, 128, 8, 3)),
               (GemvTile(32, 128, 4, 3), GemvTile(64, 256, 4, 2))]
        for tokens in (1, 16):
            x, weights, ids = self.inputs(tokens)
            nbytes = torch.unique(ids).numel() * self.expert_bytes
            for gate_up, down in few:
                def run(tiles: tuple[GemvTile, GemvTile] = (gate_up, down)) -> torch.Tensor:
                    return combine(few_row_experts(x, w13, w2, weights, ids, tiles), ids.shape[1])
                row = record("sweep", f"few-row T={tokens}", self.time(run), nbytes,
                             plan=f"gate-up {_label(gate_up)} | down {_label(down)}")
                row["ratio"] = row["GB/s"] / self.copy_gbs
        grouped = {
            64: [(GroupedTile(16, 64, 64, 4, 4), GroupedTile(16, 128, 64, 4, 4)),
                 (GroupedTile(16, 128, 64, 4, 3), GroupedTile(16, 128, 128, 4, 3)),
                 (GroupedTile(32, 64, 64, 4, 4), GroupedTile(32, 128, 64, 4, 4)),
                 (GroupedTile(16, 32, 128, 4, 4), GroupedTile(16, 64, 128, 4, 4))],
            2048: [(GroupedTile(64, 64, 64, 4, 4), GroupedTile(64, 128, 64, 4, 4)),
                   (GroupedTile(128, 128, 64, 8, 3), GroupedTile(128, 256, 64, 8, 3)),
                   (GroupedTile(128, 64, 64, 8, 4), GroupedTile(128, 128, 64, 8, 4)),
                   (GroupedTile(64, 128, 64, 4, 3), GroupedTile(64, 256, 64, 8, 3)),
                   (GroupedTile(128, 128, 32, 8, 4), GroupedTile(128, 128, 32, 8, 4)),
                   (GroupedTile(64, 64, 64, 4, 5), GroupedTile(64, 128, 64, 4, 5)),
                   (GroupedTile(128, 64, 64, 8, 3), GroupedTile(128, 128, 64, 8, 3)),
                   (GroupedTile(64, 128, 64, 8, 3), GroupedTile(64, 256, 64, 8, 3)),
                   (GroupedTile(64, 64, 128, 4, 3), GroupedTile(64, 128, 128, 4, 3)),
                   (GroupedTile(32, 64, 64, 4, 4), GroupedTile(32, 128, 64, 4, 4))],
        }
        for tokens, tiles in grouped.items():
            x, weights, ids = self.inputs(tokens)
            nbytes = torch.unique(ids).numel() * self.expert_bytes
            flops = 2 * tokens * self.s.top_k * 3 * self.s.hidden * self.s.inter
            for pair in tiles:
                def run(pair: tuple[GroupedTile, GroupedTile] = pair) -> torch.Tensor:
                    layout = align_slots(ids, w13.shape[0], pair[0].block_m)
                    return combine(grouped_experts(x, w13, w2, weights, layout, ids.shape[1], pair), ids.shape[1])
                row = record("sweep", f"grouped T={tokens}", self.time(run), nbytes, flops,
                             plan=f"gate-up {_label(pair[0])} | down {_label(pair[1])}")
                row["ratio"] = row["GB/s"] / self.copy_gbs if tokens < 1024 else row["TFLOP/s"] / self.matmul_tflops

    def chain(self, layers: int = 16) -> None:
        """Decode as the engine runs it: `layers` MoE layers of distinct weights in one CUDA graph (no L2
        reuse between them, the launch gaps of a real step), per-layer time of the few-row path's tiles."""
        s = self.s
        gen = torch.Generator(device=s.device).manual_seed(1)
        stacks = [(torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen, device=s.device, dtype=s.dtype) * 0.02,
                   torch.randn(s.experts, s.hidden, s.inter, generator=gen, device=s.device, dtype=s.dtype) * 0.02)
                  for _ in range(layers)]
        few_tiles = [None, (GemvTile(16, 128, 4, 4), GemvTile(32, 128, 4, 4))]
        for tokens in (1, 4, 16):
            x, weights, ids = self.inputs(tokens)
            nbytes = torch.unique(ids).numel() * self.expert_bytes
            reference = fused_experts_ref(x.float(), stacks[0][0].float(), stacks[0][1].float(), weights, ids)
            scale = reference.abs().max().item()

            def per_layer(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
                error = (step(*stacks[0]).float() - reference).abs().max().item() / scale
                if error > 2e-2:
                    self.failures += 1
                    print(f"MISMATCH {error:.1e}", flush=True)
                return self.time(lambda: [step(w13, w2) for w13, w2 in stacks]) / layers

            for tiles in few_tiles:
                def two_launch(w13: torch.Tensor, w2: torch.Tensor, tiles=tiles) -> torch.Tensor:
                    return combine(few_row_experts(x, w13, w2, weights, ids, tiles), ids.shape[1])
                label = "default" if tiles is None else f"gate-up {_label(tiles[0])} | down {_label(tiles[1])}"
                row = record("chain", f"few-row T={tokens}", per_layer(two_launch), nbytes, plan=label)
                row["ratio"] = row["GB/s"] / self.copy_gbs
        stacks.clear()

    def grouped_ceiling(self) -> None:
        """cuBLAS batched GEMMs of the same FLOPs with every expert given the mean rows (no routing):
        what a grouped GEMM could reach at the prefill shape."""
        s = self.s
        rows = s.prefill * s.top_k // s.experts
        x = torch.randn(s.experts, rows, s.hidden, device=s.device, dtype=s.dtype)
        w13 = torch.randn(s.experts, s.hidden, 2 * s.inter, device=s.device, dtype=s.dtype)
        a = torch.randn(s.experts, rows, s.inter, device=s.device, dtype=s.dtype)
        w2 = torch.randn(s.experts, s.inter, s.hidden, device=s.device, dtype=s.dtype)
        flops = 2 * s.experts * rows * 3 * s.hidden * s.inter
        row = record("sweep", f"cuBLAS bmm, {rows} rows per expert", self.time(lambda: (torch.bmm(x, w13), torch.bmm(a, w2))),
                     flops=flops, plan="uniform rows, no gather")
        row["ratio"] = row["TFLOP/s"] / self.matmul_tflops


def _label(tile: GemvTile | GroupedTile) -> str:
    m = f"m{tile.block_m} " if isinstance(tile, GroupedTile) else ""
    return f"{m}n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def record(group: str, name: str, seconds: float, nbytes: float = 0, flops: float = 0, **extra: object) -> dict:
    row = {"group": group, "name": name, "us": seconds * 1e6, "GB/s": nbytes / seconds / 1e9,
           "TFLOP/s": flops / seconds / 1e12, **extra}
    rows.append(row)
    return row


def print_table() -> None:
    print("\n| group | case | path | experts | µs | GB/s | TFLOP/s | ratio | target | check | experts only µs "
          "| reference µs | speed-up | plan |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        ratio = f"{r['ratio']:.0%}" if "ratio" in r else ""
        target = f"{r['target']:.0%}" if r.get("target") else ""
        experts = f"{r['experts_us']:.1f}" if "experts_us" in r else ""
        reference = f"{r['reference_us']:.0f}" if "reference_us" in r else ""
        speedup = f"{r['reference_us'] / r['us']:.1f}x" if "reference_us" in r else ""
        print(f"| {r['group']} | {r['name']} | {r.get('path', '')} | {r.get('unique', '')} | {r['us']:.1f} | "
              f"{r['GB/s']:.0f} | {r['TFLOP/s']:.1f} | {ratio} | {target} | {r.get('check', '')} | {experts} | "
              f"{reference} | {speedup} | {r.get('plan', '')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time other tiles of both paths")
    parser.add_argument("--chain", action="store_true", help="decode paths and tiles over 16 layers in one graph")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run with TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    began = time.perf_counter()
    torch.manual_seed(0)
    s = SMOKE if args.smoke else FULL
    if s.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bench = Bench(s)
    bench.ceilings()
    for tokens in s.decode:
        bench.layer(tokens, prefill=False)
    bench.layer(s.prefill, prefill=True)
    if args.sweep:
        bench.sweep()
        bench.grouped_ceiling()
    if args.chain:
        bench.chain(16 if s.device == "cuda" else 2)
    print(f"copy {bench.copy_gbs:.0f} GB/s, bf16 matmul {bench.matmul_tflops:.0f} TFLOP/s, "
          f"{time.perf_counter() - began:.0f} s")
    print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": bench.copy_gbs, "matmul_TFLOPs": bench.matmul_tflops, "rows": rows}, f, indent=1)
    if bench.failures:
        sys.exit(f"{bench.failures} token count(s) disagree with the reference")


if __name__ == "__main__":
    main()

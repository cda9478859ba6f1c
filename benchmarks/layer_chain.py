"""A batch-1 decode step's kernels alone, with and without programmatic dependent launch.

The decoder layers of Llama-3.1-8B shape at batch 1 (context 128, and 32k with FP8 KV) and of
Llama-3.2-1B shape (a draft model, context 256), built from tokenmill's kernels (one-row
matmuls, fused norms, rotary + KV write, paged attention, SiLU-and-mul), each layer with its
own weights, captured in one CUDA graph. With dependent launch each one-row matmul starts while
the kernel before it finishes and reads its first strip of weights before it waits for that
kernel's output; the table says whether the output stays equal to plain launches.

    python benchmarks/layer_chain.py
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import graph_time  # noqa: E402

from tokenmill.kernels.activation import silu_and_mul  # noqa: E402
from tokenmill.kernels.attention import paged_attention, plan_attention  # noqa: E402
from tokenmill.kernels.gemv import gemv  # noqa: E402
from tokenmill.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from tokenmill.kernels.rotary import rotate_and_cache_  # noqa: E402

FP8 = torch.float8_e4m3fn
PAGE = 16


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


LLAMA_8B = Shape(32, 4096, 32, 8, 128, 14336)
LLAMA_1B = Shape(16, 2048, 32, 8, 64, 8192)


class Chain:
    def __init__(self, shape: Shape, context: int, kv_dtype: torch.dtype) -> None:
        dev, bf16 = "cuda", torch.bfloat16
        self.s = s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=dev, dtype=bf16) * 0.02

        self.w = [dict(qkv=w(qkv, s.hidden), o=w(s.hidden, s.heads * s.head_dim), gate_up=w(2 * s.inter, s.hidden),
                       down=w(s.hidden, s.inter)) for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=dev, dtype=bf16)
        blocks = context // PAGE + 1
        self.kv = [torch.randn(2, blocks, PAGE, s.kv_heads, s.head_dim, device=dev, dtype=bf16).to(kv_dtype)
                   for _ in range(s.layers)]
        self.block_table = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
        self.seq_lens = torch.tensor([context], device=dev, dtype=torch.int32)
        self.qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
        self.positions = torch.tensor([context - 1], device=dev)
        self.slot = torch.tensor([context - 1], device=dev)
        angles = torch.arange(context, device=dev)[:, None] * torch.rand(s.head_dim // 2, device=dev)[None]
        self.cos, self.sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        self.plan = plan_attention(num_tokens=1, num_requests=1, max_query_len=1, max_seq_len=context, num_heads=s.heads,
                                   num_kv_heads=s.kv_heads, head_dim=s.head_dim, device=torch.device(dev),
                                   kv_dtype=kv_dtype)
        self.x = torch.randn(1, s.hidden, device=dev, dtype=bf16)

    def step(self, pdl: bool) -> torch.Tensor:
        def mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return gemv(x, weight, pdl=pdl)

        s = self.s
        x, residual = self.x, self.x.clone()
        for i in range(s.layers):
            w = self.w[i]
            x, residual = fused_add_rms_norm(x, residual, self.norm, 1e-5)
            q, k, v = mm(x, w["qkv"]).split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
            q = q.view(1, s.heads, s.head_dim)
            rotate_and_cache_(self.positions, q, k.view(1, s.kv_heads, s.head_dim), v.view(1, s.kv_heads, s.head_dim),
                              self.cos, self.sin, self.kv[i], self.slot)
            out = paged_attention(q, self.kv[i][0], self.kv[i][1], self.qsl, self.seq_lens, self.block_table,
                                  s.head_dim**-0.5, self.plan)
            x = mm(out.flatten(1), w["o"])
            x, residual = fused_add_rms_norm(x, residual, self.norm, 1e-5)
            x = mm(silu_and_mul(mm(x, w["gate_up"])), w["down"])
        return x


def replay_ms(chain: Chain, pdl: bool) -> tuple[float, torch.Tensor]:
    """Median ms of one replay of the captured step, and the step's output after it."""
    outputs: list[torch.Tensor] = []
    seconds = graph_time(lambda: outputs.append(chain.step(pdl)))
    return 1e3 * seconds, outputs[-1].clone()  # the captured step's output, as the last replay left it


def main() -> None:
    print("| chain | launch | ms per step | ratio | output equal |\n|---|---|---:|---:|---|")
    cases = ((LLAMA_8B, 128, torch.bfloat16, "8B, ctx 128, bf16 KV"), (LLAMA_8B, 32768, FP8, "8B, ctx 32k, fp8 KV"),
             (LLAMA_1B, 256, torch.bfloat16, "1B (a draft), ctx 256, bf16 KV"))
    for shape, context, kv_dtype, name in cases:
        torch.manual_seed(0)
        chain = Chain(shape, context, kv_dtype)
        runs: dict[bool, list[tuple[float, torch.Tensor]]] = {False: [], True: []}
        for _ in range(3):  # interleaved, so drift in clocks hits both alike
            for pdl in (False, True):
                runs[pdl].append(replay_ms(chain, pdl))
        base = statistics.median(ms for ms, _ in runs[False])
        for pdl in (False, True):
            ms = statistics.median(ms for ms, _ in runs[pdl])
            same = torch.equal(runs[pdl][0][1], runs[False][0][1])
            print(f"| {name} | {'dependent' if pdl else 'plain'} | {ms:.3f} | {ms / base:.3f} | {same} |", flush=True)
        del chain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

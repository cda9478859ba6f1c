"""One-row matmul for batch-1 decode: y = x @ W.T (+ b) with x [1, K] and a row-major W [N, K].

A batch-1 linear layer is a pure stream over W's bytes. Each program owns BLOCK_N rows of W
and walks K in BLOCK_K strips, keeping an fp32 partial sum per (row, lane) and reducing across
lanes once at the end, so the loop body is loads and FMAs only. No split-K: every projection of
interest has N >= 2048, enough programs to fill the machine without atomics or a second pass.

On an H200 this beats cuBLAS at M = 1 by 2-16% per Llama-3.1-8B / 3.2-1B projection (measured in
benchmarks/decode_profile.py; cuBLAS also adds split-K reduce kernels). At M = 5 (a verify
step) a tl.dot variant that streams W once measured no better than cuBLAS, so only M = 1 is here.

On sm_90 and later it is launched as a programmatic dependent of the kernel before it (which
calls `launch_next` as it starts): its programs become resident while that kernel runs and read
their first strip of W, which never depends on it, before `gdc_wait`. At batch 1 the kernels
before each projection (norms, attention, SiLU) occupy a few multiprocessors for microseconds,
time in which DRAM would otherwise idle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenmill.kernels._common import dependent_launch, interpreting


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemv_tile(n: int, k: int) -> GemvTile:
    """The best tile the H200 sweep found per projection shape, generalised by size."""
    if interpreting():
        return GemvTile(4, 32, 1, 1)
    if n >= 16384:  # gate_up, lm_head: plenty of programs; short strips keep loads in flight
        return GemvTile(8 if k <= 2048 else 16, 256, 4, 4)
    if k >= 8192 and n >= 4096:  # down_proj: long rows, more programs
        return GemvTile(4, 512, 4, 4)
    if k <= 2048 or n < 4096:  # small (draft) models
        return GemvTile(8, 1024, 8, 3)
    if n >= 6144:  # qkv_proj
        return GemvTile(16, 512, 8, 4)
    return GemvTile(8, 512, 4, 3)  # o_proj


@triton.jit
def _w_strip(w_ptrs, k0, offs_k, n_ok, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
    return tl.load(w_ptrs + k0, mask=n_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)


@triton.jit
def _x_strip(x_ptr, k0, offs_k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + k0 + offs_k)
    return tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)


@triton.jit
def _fma(acc, w, x):
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PDL:
        # Launched while the kernel before it (a norm, attention, SiLU) still runs: W never
        # depends on it, so the first strip of W is read now, x only after gdc_wait. (Reading
        # two or four strips early was slower: benchmarks/RESULTS.md, 2026-11-30 late.)
        w = _w_strip(w_ptrs, 0, offs_k, n_ok, K, EVEN_K)
        gdc_wait()
        acc = _fma(acc, w, _x_strip(x_ptr, 0, offs_k, K, EVEN_K))
    for k0 in range(BLOCK_K if PDL else 0, K, BLOCK_K):
        acc = _fma(acc, _w_strip(w_ptrs, k0, offs_k, n_ok, K, EVEN_K), _x_strip(x_ptr, k0, offs_k, K, EVEN_K))
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: GemvTile | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype. pdl (default: where the device
    has it) launches it as a programmatic dependent of the kernel before it."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, K] and a row-major weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    tile = tile or gemv_tile(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device) if pdl is None else pdl
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
        PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)

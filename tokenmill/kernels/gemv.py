"""Few-row matmul for decode: y = x @ (W * scale).T (+ b), x [M, K] with M <= MAX_ROWS, a row-major
W [N, K] in the activations' float type or FP8 E4M3 with one scale per output row.

A decode step at batch 1 (and the few rows of a verify or catch-up step) is a pure stream over
W's bytes. Each program owns BLOCK_N rows of W and walks K in BLOCK_K strips, loading each strip
once and multiplying it into one fp32 partial sum per (x row, W row, lane), reducing across lanes
once at the end, so the loop body is loads and FMAs only. The rows of x each keep their own
accumulator (separate variables, so W's registers are shared, never re-laid out per row). No
split-K: every projection of interest has N >= 2048, enough programs to fill the machine without
atomics or a second pass.

At M = 1 this beats cuBLAS per projection (benchmarks/decode_profile.py measures it; cuBLAS also
adds split-K reduce kernels). FP8 weights (a quantized draft) halve the bytes; they are widened to
fp32 in registers (bound by the conversions, so less than twice as fast as bf16 weights), and the
row's scale multiplies the sum (weight-only: x is never quantized). With more rows of x the loop
holds more accumulators and fewer programs fit each multiprocessor: the kernel loses to cuBLAS
from M = 2 for most shapes, so unquantized weights use it at M = 1 only (benchmarks/RESULTS.md
has the figures).

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

from tokenmill.kernels._common import (
    FP8_DTYPE,
    apply_block_scales,
    block_scales,
    dependent_launch,
    interpreting,
    scale_launch,
)
from tokenmill.numerics import ScaleBlock, dequantize_blocks, scale_grid_shape

MAX_ROWS = 8  # rows of x one launch takes: a separate accumulator each


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemv_tile(n: int, k: int, rows: int = 1, fp8: bool = False) -> GemvTile:
    """The best one-row tile a sweep found per projection shape (decode_profile.py), generalised by size; with
    more rows, strips shrink so that the accumulators (rows x block_n x block_k fp32 over the
    threads) stay within ~64 registers a thread."""
    if interpreting():
        return GemvTile(4, 32, 1, 1)
    if n >= 16384 and fp8 and k <= 2048:  # a draft's FP8 gate_up and head: more rows per program
        tile = GemvTile(32, 256, 8, 3)
    elif n >= 16384:  # gate_up, lm_head: plenty of programs; short strips keep loads in flight
        tile = GemvTile(8 if k <= 2048 else 16, 256, 4, 4)
    elif k >= 8192 and n >= 4096:  # down_proj: long rows, more programs
        tile = GemvTile(4, 512, 4, 4)
    elif k >= 8192:  # a small model's down_proj (1B: 2048 x 8192): few rows, so long strips
        tile = GemvTile(4, 2048, 4, 3)
    elif k <= 2048 or n < 4096:  # small (draft) models
        tile = GemvTile(8, 1024, 8, 3)
    elif n >= 6144:  # qkv_proj
        tile = GemvTile(16, 512, 8, 4)
    else:
        tile = GemvTile(8, 512, 4, 3)  # o_proj
    block_k = tile.block_k
    while rows > 1 and block_k > 64 and rows * tile.block_n * block_k > 64 * 32 * tile.num_warps:
        block_k //= 2
    return GemvTile(tile.block_n, block_k, tile.num_warps, tile.num_stages)


@triton.jit
def _w_strip(w_ptrs, k0, offs_k, n_ok, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
    return tl.load(w_ptrs + k0, mask=n_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, w, x_row_ptr, k0, offs_k, K, EVEN_K: tl.constexpr, USED: tl.constexpr):
    """acc + w * x[k0 : k0 + BLOCK_K] of one row of x (w already float32); acc unchanged for a row past M."""
    if USED:
        if EVEN_K:
            x = tl.load(x_row_ptr + k0 + offs_k)
        else:
            x = tl.load(x_row_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
        acc = acc + w * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def _accumulate_rows(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptr, stride_xm, k0, offs_k, K,
                     EVEN_K: tl.constexpr, ROWS: tl.constexpr):
    """Each of the first ROWS accumulators plus w times its row of x at strip k0."""
    acc0 = _accumulate(acc0, w, x_ptr, k0, offs_k, K, EVEN_K, True)
    acc1 = _accumulate(acc1, w, x_ptr + stride_xm, k0, offs_k, K, EVEN_K, ROWS > 1)
    acc2 = _accumulate(acc2, w, x_ptr + 2 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 2)
    acc3 = _accumulate(acc3, w, x_ptr + 3 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 3)
    acc4 = _accumulate(acc4, w, x_ptr + 4 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 4)
    acc5 = _accumulate(acc5, w, x_ptr + 5 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 5)
    acc6 = _accumulate(acc6, w, x_ptr + 6 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 6)
    acc7 = _accumulate(acc7, w, x_ptr + 7 * stride_xm, k0, offs_k, K, EVEN_K, ROWS > 7)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_row(acc, y_row_ptr, offs_n, n_ok, scale, bias, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
               USED: tl.constexpr):
    if USED:
        y = tl.sum(acc, 1)
        if HAS_SCALE:
            y = y * scale
        if HAS_BIAS:
            y += bias
        tl.store(y_row_ptr + offs_n, y.to(y_row_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _scaled_strip(w_ptrs, scale_ptr, offs_n, n_ok, k0, offs_k, K, stride_sn, EVEN_K: tl.constexpr,
                  SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The strip of W at k0 in float32, times its block scales when the weight has them."""
    w = _w_strip(w_ptrs, k0, offs_k, n_ok, K, EVEN_K).to(tl.float32)
    if SCALE_COLS > 0:
        s = block_scales(scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, BLOCK_K, E8M0)
        w = apply_block_scales(w, s, BLOCK_N, BLOCK_K, SCALE_COLS)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    ROWS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    k_start = 0
    if PDL:
        # Launched while the kernel before it (a norm, attention, SiLU) still runs: W never
        # depends on it, so the first strip of W is read now, x only after gdc_wait (reading more
        # strips early was slower: benchmarks/RESULTS.md).
        w = _scaled_strip(w_ptrs, scale_ptr, offs_n, n_ok, 0, offs_k, K, stride_sn, EVEN_K, SCALE_ROWS, SCALE_COLS,
                          E8M0, BLOCK_N, BLOCK_K)
        gdc_wait()
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _accumulate_rows(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptr, stride_xm, 0, offs_k, K, EVEN_K, ROWS)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _scaled_strip(w_ptrs, scale_ptr, offs_n, n_ok, k0, offs_k, K, stride_sn, EVEN_K, SCALE_ROWS, SCALE_COLS,
                          E8M0, BLOCK_N, BLOCK_K)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _accumulate_rows(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptr, stride_xm, k0, offs_k, K, EVEN_K, ROWS)
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0) if HAS_SCALE else 1.0
    bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    _store_row(acc0, y_ptr, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, True)
    _store_row(acc1, y_ptr + stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 1)
    _store_row(acc2, y_ptr + 2 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 2)
    _store_row(acc3, y_ptr + 3 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 3)
    _store_row(acc4, y_ptr + 4 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 4)
    _store_row(acc5, y_ptr + 5 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 5)
    _store_row(acc6, y_ptr + 6 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 6)
    _store_row(acc7, y_ptr + 7 * stride_ym, offs_n, n_ok, scale, bias, HAS_SCALE, HAS_BIAS, ROWS > 7)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: GemvTile | None = None,
    pdl: bool | None = None,
    weight_scale: torch.Tensor | None = None,
    scale_block: ScaleBlock | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, for M <= MAX_ROWS, W = weight [N, K] times
    its scales: weight_scale float32 [N] (one per row), or with scale_block (r, c) a grid
    [ceil(N / r), ceil(K / c)] of float32 or E8M0 codes (uint8) (`numerics.dequantize_blocks`).
    Scales are required for FP8 weights and refused otherwise. pdl (default: where the device has
    it) launches it as a programmatic dependent of the kernel before it."""
    check_operands("gemv", x, weight, weight_scale, MAX_ROWS, scale_block)
    n, k = weight.shape
    rows = x.shape[0]
    tile = tile or gemv_tile(n, k, rows, weight.dtype == FP8_DTYPE)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device) if pdl is None else pdl
    scaling = scale_launch(weight, weight_scale, scale_block, tile.block_k)
    _gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x, weight, weight_scale if weight_scale is not None else weight, bias if bias is not None else weight, y,
        n, k, x.stride(0), weight.stride(0), y.stride(0),
        ROWS=rows, HAS_SCALE=weight_scale is not None and not scaling["SCALE_COLS"], HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
        PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl, **scaling,
    )
    return y


def check_operands(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, max_rows: int | None,
    scale_block: ScaleBlock | None = None,
) -> None:
    """Refuse what a weight-streaming kernel cannot take: x other than [M <= max_rows (None: any
    M >= 1), K] or not row-major, a weight not row-major, an FP8 weight without its scales (float32
    per row, or a block grid) or a scale without one."""
    n, k = weight.shape
    rows_ok = x.dim() == 2 and x.shape[0] >= 1 and (max_rows is None or x.shape[0] <= max_rows)
    if not rows_ok or x.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        limit = "M" if max_rows is None else f"M <= {max_rows}"
        raise ValueError(f"{kernel} takes x [{limit}, K] and a row-major weight [N, K]; "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}")
    if (weight.dtype == FP8_DTYPE) != (weight_scale is not None):
        raise ValueError("FP8 weights need a float32 weight_scale per output row, and only FP8 weights take one")
    if weight_scale is None:
        return
    if scale_block is None:
        if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
            raise ValueError(f"weight_scale must be float32 [{n}], got {weight_scale.dtype} {tuple(weight_scale.shape)}")
        return
    grid = scale_grid_shape(n, k, scale_block)
    e8m0_ok = weight_scale.dtype == torch.uint8 and scale_block[1] > 0
    if tuple(weight_scale.shape) != grid or not (weight_scale.dtype == torch.float32 or e8m0_ok) \
            or weight_scale.stride(-1) != 1:
        raise ValueError(f"block scales {scale_block} of a [{n}, {k}] weight must be a row-major float32 (or E8M0 "
                         f"uint8) grid {grid}, got {weight_scale.dtype} {tuple(weight_scale.shape)}")


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
    scale_block: ScaleBlock | None = None,
) -> torch.Tensor:
    """The same product in float32 by torch (FP8 weights dequantized first)."""
    if weight_scale is None:
        w = weight.float()
    elif scale_block is None:
        w = weight.float() * weight_scale[:, None]
    else:
        w = dequantize_blocks(weight, weight_scale, scale_block)
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())

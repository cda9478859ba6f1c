"""Few-row matmul on tensor cores: y = x @ (W * scale).T (+ b) for x [M, K] with M <= 16 (the
engine uses it from M = 2): a verify step's 1 + γ rows, a bf16 draft's catch-up, decode at a
small batch.

Like the one-row kernel (gemv.py) it is a stream over W's bytes, but the products run on the
tensor cores: each program owns BLOCK_N rows of W and computes W_tile @ x^T ([BLOCK_N, BLOCK_K]
@ [BLOCK_K, 16], x's rows padded with zeros to the MMA's 16), so the weight is the MMA's wide
operand and x the narrow one. The FMA kernel keeps a separate accumulator per row of x and
runs out of registers from M = 2; here the accumulator is [BLOCK_N, 16] whatever M is. No
split-K: every projection of interest has N >= 2048, enough programs to fill the machine.

FP8 weights (E4M3, float32 scale per output row) are widened to x's dtype in registers before
the MMA, which is exact (every E4M3 value is a bf16 and an fp16 value); the row's scale
multiplies the sum (weight-only: x is never quantized). float32 x multiplies in IEEE float32.

`fp8_linear` runs the same kernel over any number of rows (the grid also tiles x's rows, the
row tiles of one W tile launched next to each other so W is read from DRAM about once): an FP8
draft's prompt pass, which would otherwise widen every weight into memory first.
"""

from __future__ import annotations

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
    mm,
    scale_launch,
)
from tokenmill.kernels.gemv import GemvTile, check_operands
from tokenmill.numerics import ScaleBlock

MMA_ROWS = 16  # x's rows padded to the MMA's narrow side; the most one few_row_mma launch takes


def many_rows_tile(n: int) -> tuple[GemvTile, int]:
    """fp8_linear's (W tile, rows of x per program) past MMA_ROWS rows: the best of a sweep at
    prompt-pass row counts (benchmarks/RESULTS.md); narrower programs where N is small, so that
    enough of them run."""
    if n < 4096:
        return GemvTile(64, 128, 4, 4), 64
    return GemvTile(128, 64, 8, 4), 128


def few_row_mma_tile(n: int, k: int) -> GemvTile:
    """The tile a sweep found best per projection shape (benchmarks/RESULTS.md), generalised by
    size: wide programs for the wide weights, narrow ones (more of them, deeper pipelines) for
    the small."""
    if interpreting():
        return GemvTile(16, 32, 1, 1)
    if n >= 16384:  # gate_up, lm_head, a draft's head
        return GemvTile(64, 128, 4, 4)
    if n >= 6144 or (n >= 3072 and k <= 2048):  # qkv_proj
        return GemvTile(64, 256, 4, 3)
    if n >= 4096:  # o_proj
        return GemvTile(32, 128, 4, 6)
    return GemvTile(16, 256, 4, 6)  # a small model's o_proj


def few_row_mma_suits(n: int, k: int) -> bool:
    """Whether the kernel beats cuBLAS on a weight of [n, k] (measured at 2, 5 and 16 rows): not
    on rows much longer than there are rows (down_proj), where cuBLAS splits K and it does not."""
    return k <= 2 * n


@triton.jit
def scaled_mma(w, xt, acc, scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS: tl.constexpr,
               SCALE_COLS: tl.constexpr, E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + (w [BLOCK_N, BLOCK_K] times its block scales) @ xt, w widened to xt's dtype. A strip in
    one scale group multiplies first and scales its partial sum (exact for any float32 scale);
    smaller groups (MX) are scaled in registers before the MMA (exact: powers of two)."""
    if SCALE_COLS >= BLOCK_K:
        s = block_scales(scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, BLOCK_K, E8M0)
        acc = acc + mm(w.to(xt.dtype), xt, tl.zeros(acc.shape, tl.float32), UPCAST, IEEE) * s[:, None]
    elif SCALE_COLS > 0:
        s = block_scales(scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, BLOCK_K, E8M0)
        w = apply_block_scales(w.to(tl.float32), s, BLOCK_N, BLOCK_K, SCALE_COLS)
        acc = mm(w.to(xt.dtype), xt, acc, UPCAST, IEEE)
    else:
        acc = mm(w.to(xt.dtype), xt, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _few_row_mma_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PDL:
        gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
            xt = tl.load(xt_ptrs + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(xt_ptrs + k0, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = scaled_mma(w, xt, acc, scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, E8M0,
                         BLOCK_N, BLOCK_K, UPCAST, IEEE)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def few_row_mma(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: GemvTile | None = None,
    pdl: bool | None = None,
    weight_scale: torch.Tensor | None = None,
    scale_block: ScaleBlock | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, for M <= MMA_ROWS, W = weight [N, K] times
    its scales (float32 [N] per row, or a block grid with scale_block: see gemv). Scales are
    required for FP8 weights and refused otherwise. pdl (default: where the device has it)
    launches it as a programmatic dependent of the kernel before it."""
    check_operands("few_row_mma", x, weight, weight_scale, MMA_ROWS, scale_block)
    if weight_scale is None and weight.dtype != x.dtype:
        raise ValueError(f"weight ({weight.dtype}) and x ({x.dtype}) must share a dtype unless the weight is FP8")
    return _launch(x, weight, bias, weight_scale, scale_block, tile or few_row_mma_tile(*weight.shape), MMA_ROWS, pdl)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor,
    scale_block: ScaleBlock | None = None, pdl: bool | None = None, tile: GemvTile | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, for any M, W = weight [N, K] as FP8 E4M3
    times its scales (per row, or a block grid with scale_block): FP8 read straight from the
    weight, as in few_row_mma (weight-only; MX weights' prefill on Hopper)."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear takes an FP8 E4M3 weight, got {weight.dtype}")
    check_operands("fp8_linear", x, weight, weight_scale, None, scale_block)
    # The interpreter keeps 16-row tiles for any rows: small blocks run quickly there, and the CPU
    # tests' few dozen rows still cross several row tiles.
    if tile is not None or x.shape[0] <= MMA_ROWS or interpreting():
        return _launch(x, weight, bias, weight_scale, scale_block, tile or few_row_mma_tile(*weight.shape), MMA_ROWS,
                       pdl)
    return _launch(x, weight, bias, weight_scale, scale_block, *many_rows_tile(weight.shape[0]), pdl)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_scale: torch.Tensor | None,
    scale_block: ScaleBlock | None, tile: GemvTile, block_m: int, pdl: bool | None,
) -> torch.Tensor:
    n, k = weight.shape
    rows = x.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device) if pdl is None else pdl
    scaling = scale_launch(weight, weight_scale, scale_block, tile.block_k)
    _few_row_mma_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, tile.block_n))](
        x, weight, weight_scale if weight_scale is not None else weight, bias if bias is not None else weight, y,
        rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_SCALE=weight_scale is not None and not scaling["SCALE_COLS"], HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0,
        UPCAST=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
        PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl, **scaling,
    )
    return y

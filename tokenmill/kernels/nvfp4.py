"""NVFP4 weights multiplied on CUDA: E2M1 elements (two per byte along K, element 2j in byte j's
low nibble), one E4M3 scale per 16 elements and a float32 scale per output row (the checkpoint's
per-tensor weight_scale_2 of each fused shard, repeated down its rows):

    W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] * row_scale[n]

Hopper has no FP4 tensor-core instruction, so the weight is decoded in registers and multiplied
in x's dtype (W4A16). A packed strip of BLOCK_K / 2 bytes decodes into its even and its odd
element columns, each [BLOCK_N, BLOCK_K / 2], which multiply x's even and odd columns: two MMAs,
and no interleaving of registers. e2m1 * scale has at most 6 significant bits, so the decoded
tile is exact in bf16 and fp16; row_scale multiplies the float32 sum.

`nvfp4_linear` runs one kernel for any number of rows (the grid tiles x's rows too; decode
launches it as a programmatic dependent, as few_row_mma.py does). W4A4 (Blackwell) quantizes
x per 16 under its global input scale first (`quantize_nvfp4_activations`). The experts kernels
(kernels/moe) take the same strips through `fp4_dequant`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenmill.kernels._common import (
    E4M3_MAX,
    FP8_DTYPE,
    apply_block_scales,
    dependent_launch,
    interpreting,
    mm,
    round_to_e4m3_grid,
)
from tokenmill.kernels.gemv import GemvTile
from tokenmill.numerics import NVFP4_GROUP, dequantize_nvfp4, quantize_nvfp4

MMA_ROWS = 16
DECODE_SCALE = 16384.0  # 2^14: _e2m1 returns e2m1 * 2^-14


def nvfp4_tile(n: int, k: int, rows: int) -> tuple[GemvTile, int]:
    """(W tile, rows of x per program): few rows stream W (BLOCK_M = 16, the MMA's narrow side),
    more rows tile x as fp8_linear does. BLOCK_K counts elements (BLOCK_K / 2 bytes a row)."""
    if interpreting():
        return GemvTile(16, 32, 1, 1), MMA_ROWS
    if rows > MMA_ROWS:
        return (GemvTile(64, 128, 4, 4), 64) if n < 4096 else (GemvTile(128, 128, 8, 3), 128)
    if n >= 16384:
        return GemvTile(64, 256, 4, 4), MMA_ROWS
    if n >= 4096:
        return GemvTile(32, 256, 4, 4), MMA_ROWS
    return GemvTile(16, 256, 4, 4), MMA_ROWS


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0-15) as float32 times 2^-14: the three magnitude bits at the top of an
    fp16's exponent and mantissa make an fp16 equal to e2m1 * 2^-14, exactly (code 1, 0.5, is the
    subnormal 2^-15), and the sign bit moves to the fp16's."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp4_dequant(wb, like, s_base, offs_n, n_ok, k0, K, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(even, odd) element columns [BLOCK_N, BLOCK_K // 2] of the packed strip wb [BLOCK_N, BLOCK_K // 2]
    (uint8, element columns k0 : k0 + BLOCK_K of rows offs_n) times their E4M3 group scales (a grid
    at s_base with row stride stride_sn), in like's dtype."""
    groups = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    s = tl.load(s_base + offs_n[:, None].to(tl.int64) * stride_sn + groups[None, :],
                mask=n_ok[:, None] & (groups * 16 < K)[None, :], other=0.0).to(tl.float32) * 16384.0
    b = wb.to(tl.int32)
    even = apply_block_scales(_e2m1(b & 15), s, BLOCK_N, BLOCK_K // 2, 8)
    odd = apply_block_scales(_e2m1(b >> 4), s, BLOCK_N, BLOCK_K // 2, 8)
    return even.to(like.dtype), odd.to(like.dtype)


@triton.jit
def _nvfp4_linear_kernel(
    x_ptr, w_ptr, s_ptr, r_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    m_ok = offs_m < M
    offs_b = tl.arange(0, BLOCK_K // 2)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_b[None, :]
    xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + 2 * offs_b[:, None]  # x's even columns, transposed
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PDL:
        gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            wb = tl.load(w_ptrs + k0 // 2, mask=n_ok[:, None], other=0)
            xe = tl.load(xt_ptrs + k0, mask=m_ok[None, :], other=0.0)
            xo = tl.load(xt_ptrs + k0 + 1, mask=m_ok[None, :], other=0.0)
        else:
            b_ok = k0 + 2 * offs_b < K
            wb = tl.load(w_ptrs + k0 // 2, mask=n_ok[:, None] & b_ok[None, :], other=0)
            xe = tl.load(xt_ptrs + k0, mask=m_ok[None, :] & b_ok[:, None], other=0.0)
            xo = tl.load(xt_ptrs + k0 + 1, mask=m_ok[None, :] & b_ok[:, None], other=0.0)
        even, odd = fp4_dequant(wb, xe, s_ptr, offs_n, n_ok, k0, K, stride_sn, BLOCK_N, BLOCK_K)
        acc = mm(even, xe, acc, UPCAST, IEEE)
        acc = mm(odd, xo, acc, UPCAST, IEEE)
    acc = acc * tl.load(r_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def check_nvfp4_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         row_scale: torch.Tensor) -> None:
    """Refuse what the kernel cannot take: x not [M, K] row-major, K not a multiple of 16, a weight
    other than row-major uint8 [N, K / 2], scales other than E4M3 [N, K / 16] and float32 [N]."""
    n, half = weight.shape
    k = 2 * half
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a row-major float [M, {k}] beside a packed [{n}, {half}] weight, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != torch.uint8 or weight.stride(1) != 1 or k % NVFP4_GROUP:
        raise ValueError(f"an NVFP4 weight is row-major uint8 [N, K / 2] with K a multiple of {NVFP4_GROUP}, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if weight_scale.dtype != FP8_DTYPE or tuple(weight_scale.shape) != (n, k // NVFP4_GROUP) or weight_scale.stride(1) != 1:
        raise ValueError(f"weight_scale must be a row-major E4M3 [{n}, {k // NVFP4_GROUP}], "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (n,):
        raise ValueError(f"row_scale must be float32 [{n}], got {row_scale.dtype} {tuple(row_scale.shape)}")


def nvfp4_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, row_scale: torch.Tensor,
    bias: torch.Tensor | None = None, tile: tuple[GemvTile, int] | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype for the NVFP4 weight W = (weight [N, K / 2],
    weight_scale [N, K / 16], row_scale [N]) (module docstring)."""
    check_nvfp4_operands(x, weight, weight_scale, row_scale)
    n, rows, k = weight.shape[0], x.shape[0], x.shape[1]
    w_tile, block_m = tile or nvfp4_tile(n, k, rows)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device) and block_m == MMA_ROWS if pdl is None else pdl
    _nvfp4_linear_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, w_tile.block_n))](
        x, weight, weight_scale, row_scale, bias if bias is not None else row_scale, y, rows, n, k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=w_tile.block_n, BLOCK_K=w_tile.block_k,
        EVEN_K=k % w_tile.block_k == 0, UPCAST=interpreting() and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=w_tile.num_warps, num_stages=w_tile.num_stages,
        launch_pdl=pdl,
    )
    return y


def nvfp4_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, row_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float32 by torch, W dequantized first."""
    w = dequantize_nvfp4(weight, weight_scale, row_scale[:, None])
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())


@triton.jit
def _e2m1_encode(a):
    """|x| (float32, scaled into the E2M1 range) -> magnitude codes 0-7: nearest, ties to the even code."""
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    return code + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)


@triton.jit
def _sign_bit(x):
    """x's float32 sign bit (-0.0 included) as E2M1's bit 3."""
    return ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 3


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, g_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, BLOCK_G: tl.constexpr,
                           EMULATE_ROUNDING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    pairs = tl.arange(0, 8)
    g_ok = groups * 16 < K
    cols = groups[:, None] * 16 + 2 * pairs[None, :]  # [BLOCK_G, 8]: each group's even columns
    even = tl.load(x_ptr + row * stride_xm + cols, mask=g_ok[:, None], other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + row * stride_xm + cols + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
    scale = tl.minimum(tl.maximum(amax / (6.0 * g), 0.001953125), E4M3_MAX)
    if EMULATE_ROUNDING:
        scale = round_to_e4m3_grid(scale)
    scale = scale.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=g_ok)
    step = (scale.to(tl.float32) * g)[:, None]
    lo = _e2m1_encode(tl.abs(even / step)) | _sign_bit(even)
    hi = _e2m1_encode(tl.abs(odd / step)) | _sign_bit(odd)
    tl.store(q_ptr + row * stride_qm + groups[:, None] * 8 + pairs[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=g_ok[:, None])


def quantize_nvfp4_activations(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (packed E2M1 uint8 [M, K / 2], E4M3 scales [M, K / 16]) under the float32 0-d
    global_scale (the layer's input_scale): `numerics.quantize_nvfp4`, bit for bit."""
    rows, k = x.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"NVFP4 activations take whole groups of {NVFP4_GROUP} columns, got {k}")
    q = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(rows, k // NVFP4_GROUP, dtype=FP8_DTYPE, device=x.device)
    block_g = 16 if interpreting() else 64
    if rows:
        _quantize_nvfp4_kernel[(rows, triton.cdiv(k // NVFP4_GROUP, block_g))](
            x, global_scale.float().reshape(1), q, s, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_G=block_g,
            EMULATE_ROUNDING=interpreting(), num_warps=4)
    return q, s


def quantize_nvfp4_activations_ref(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_nvfp4(x, global_scale.float().reshape(()))


def nvfp4_w4a4_linear(
    x: torch.Tensor, input_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    row_scale: torch.Tensor, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A4: x quantized to NVFP4 per 16 under input_scale, times the NVFP4 weight; the product of
    the two E2M1 * E4M3 operands accumulated in float32, then times input_scale * row_scale (what
    an FP4 block-scaled MMA computes). The MMA runs on the decoded operands (exact in x's dtype)."""
    q, s = quantize_nvfp4_activations(x, input_scale)
    decoded = dequantize_nvfp4(q, s, 1.0).to(x.dtype)
    return nvfp4_linear(decoded, weight, weight_scale, row_scale * input_scale.float(), bias)

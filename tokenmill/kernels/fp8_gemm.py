"""FP8 weights with block scales, multiplied on CUDA: the one entry point of every FP8-element
checkpoint format's linear layers (`scaled_fp8_linear`), and its W8A8 prefill kernels.

One row of x (decode at batch 1) streams the weight through the FMA kernel (gemv.py), weight-only:
x unquantized, and faster there than any W8A8 kernel measured (benchmarks/RESULTS.md). The
layouts whose prefill is W8A8 multiply 2 to 16 rows (verify steps, small batches, a drafter's
block) in the few-row W8A8 kernel (w8a8_few_row.py), x quantized in the kernel as the prefill
quantizes it; the MX layout (weight-only) takes up to MAX_ROWS rows through the FMA kernel and
up to MMA_ROWS through the tensor-core few-row kernel (few_row_mma.py). More rows are
compute-bound and multiply on FP8 tensor cores (W8A8), x quantized on the fly to E4M3 with scale
amax / 448 (`quantize_activations`):

- one scale per row of W (per tensor or channel): x per token, `torch._scaled_mm` with row-wise
  scales (a = x [M, K], b = W^T column-major, scale_a [M, 1], scale_b [1, N]);
- 128 x 128 block scales: x per token per 128 columns, the Triton block-scaled GEMM below, whose
  programs scale each 128-deep partial product by x's group scale and W's block scale;
- MX scales (Hopper has no MX MMA): weight-only, fp8_linear over any rows (dequantized in registers).

Where _scaled_mm's layout does not fit (fp16 / fp32 x, N or K not multiples of 16) the rows go
through fp8_linear too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import E4M3_MAX, FP8_E4M3_MAX, interpreting, round_to_e4m3_grid
from tokenmill.kernels.few_row_mma import MMA_ROWS, few_row_mma, fp8_linear
from tokenmill.kernels.gemv import MAX_ROWS, gemv
from tokenmill.kernels.w8a8_few_row import GROUP, w8a8_few_row
from tokenmill.kernels.w8a8_few_row import MMA_ROWS as W8A8_ROWS
from tokenmill.numerics import FP8_E4M3, ScaleBlock, dequantize_blocks

W8A8_PATHS = ("w8a8-rows", "w8a8-blocks")  # the prefill paths whose layouts multiply few rows W8A8 too


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm, BLOCK: tl.constexpr,
                     EMULATE_ROUNDING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, group, BLOCK):
        cols = start + k0 + tl.arange(0, BLOCK)
        ok = (k0 + tl.arange(0, BLOCK) < group) & (cols < K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)))
    top = tl.max(amax, 0)
    scale = tl.where(top > 0, top / E4M3_MAX, 1.0)
    for k0 in range(0, group, BLOCK):
        cols = start + k0 + tl.arange(0, BLOCK)
        ok = (k0 + tl.arange(0, BLOCK) < group) & (cols < K)
        q = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32) / scale
        q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
        if EMULATE_ROUNDING:
            q = round_to_e4m3_grid(q)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + tl.program_id(1), scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], float32 scales [M, ceil(K / group)]): each row's groups of `group`
    columns (group = K: per token) divided by amax / 448 (1.0 for an all-zero group)."""
    rows, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8_E4M3, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(rows, groups)](x, q, scales, k, group, x.stride(0), q.stride(0), scales.stride(0),
                                         BLOCK=min(1024, triton.next_power_of_2(group)),
                                         EMULATE_ROUNDING=interpreting(), num_warps=4)
    return q, scales


def quantize_activations_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same by torch."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(rows, -1, group)
    amax = padded.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (padded / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).flatten(1)[:, :k].to(FP8_E4M3)
    return q, scales


@triton.jit
def _block_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_sam, stride_bn, stride_sbn, stride_cm,
    SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Row tiles in groups of GROUP_M sweep the column tiles together, so their B tiles are reused from L2.
    group_first = pid // (GROUP_M * tiles_n) * GROUP_M
    group_rows = tl.minimum(tiles_m - group_first, GROUP_M)
    pid_m = group_first + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    sa_ptrs = sa_ptr + offs_m.to(tl.int64) * stride_sam
    sb_ptrs = sb_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        sa = tl.load(sa_ptrs + k0 // BLOCK_K, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptrs + k0 // BLOCK_K, mask=n_ok, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_gemm_tile(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the block-scaled GEMM (BLOCK_K is the 128 group)."""
    if interpreting():
        return 16, 16, 1, 1
    if m <= 64:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def w8a8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) in x's dtype, W = weight [N, K] (E4M3) with float32 block scales
    [ceil(N / scale_rows), ceil(K / 128)], x quantized per token per 128 columns."""
    n, k = weight.shape
    rows = x.shape[0]
    xq, xs = quantize_activations(x, GROUP)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n, warps, stages = block_gemm_tile(rows)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _block_gemm_kernel[grid](
        xq, xs, weight, scale, bias if bias is not None else weight, y, rows, n, k, xq.stride(0), xs.stride(0),
        weight.stride(0), scale.stride(0), y.stride(0),
        SCALE_ROWS=scale_rows, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8,
        UPCAST=interpreting(), num_warps=warps, num_stages=stages,
    )
    return y


def w8a8_row_linear(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16) @ (weight [N, K] * row_scale[:, None]).T (+ bias) with x quantized per
    token, on FP8 tensor cores by torch._scaled_mm (N and K multiples of 16)."""
    xq, xs = quantize_activations(x, x.shape[1])
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=row_scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias


def w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product by torch in float32: x quantized per token (block[1] = 0) or per token per
    128 columns, both operands dequantized, multiplied."""
    group = x.shape[1] if block[1] == 0 else GROUP
    xq, xs = quantize_activations_ref(x, group)
    y = dequantize_blocks(xq, xs, (1, group)) @ dequantize_blocks(weight, scale.reshape(scale.shape[0], -1), block).T
    return y if bias is None else y + bias.float()


def scaled_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock, bias: torch.Tensor | None,
    prefill: str,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for an FP8 weight with its scales (`numerics.dequantize_blocks`);
    `prefill` (scaled_fp8.PREFILL_PATHS) picks the path past the few-row kernels."""
    per_row = block[1] == 0
    scales = scale.view(-1) if per_row else scale
    scale_block = None if per_row else block
    rows = x.shape[0]
    w8a8 = prefill in W8A8_PATHS and x.dtype != torch.float32 and (per_row or block[1] == GROUP)
    if 1 < rows <= W8A8_ROWS and w8a8:
        return w8a8_few_row(x, weight, scales, None if per_row else block[0], bias)
    if rows <= MAX_ROWS:
        return gemv(x, weight, bias, weight_scale=scales, scale_block=scale_block)
    if rows <= MMA_ROWS:
        return few_row_mma(x, weight, bias, weight_scale=scales, scale_block=scale_block)
    n, k = weight.shape
    if prefill == "w8a8-rows" and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and not interpreting():
        return w8a8_row_linear(x, weight, scales, bias)
    if prefill == "w8a8-blocks" and x.dtype != torch.float32 and block[1] == GROUP:
        return w8a8_block_linear(x, weight, scale, block[0], bias)
    return fp8_linear(x, weight, bias, weight_scale=scales, scale_block=scale_block)

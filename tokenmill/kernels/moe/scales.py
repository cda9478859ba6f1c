"""The scale operand of quantized experts for the MoE kernels: each stacked weight's scales as a
grid per expert (numerics.dequantize_blocks over the last two dimensions), passed to the few-row
and grouped kernels as one pointer, expert and row strides, and the scale constexprs; NVFP4
experts add a float32 scale per weight row (their global scales), which multiplies the sums."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import scale_launch
from tokenmill.numerics import NVFP4_GROUP, ScaleBlock


@dataclass(frozen=True)
class ExpertScales:
    """w13 [E, 2I, H] and w2 [E, H, I] in FP8 E4M3: their scales [E, ceil(rows / r), ceil(cols / c)]
    (float32, or uint8 E8M0 codes) with blocks (r, c); (1, 0) is one scale per row ([E, rows, 1]).
    NVFP4 (uint8 weights [E, rows, cols / 2], two E2M1 codes a byte): E4M3 scales per (1, 16) and
    w13_rows [E, 2I], w2_rows [E, H], float32 per weight row."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_block: ScaleBlock
    w2_block: ScaleBlock
    w13_rows: torch.Tensor | None = None
    w2_rows: torch.Tensor | None = None

    @property
    def fp4(self) -> bool:
        return self.w13_rows is not None


def scale_args(scales: ExpertScales | None, which: int, weight: torch.Tensor, block_k: int) -> tuple[torch.Tensor, dict]:
    """(scale pointer, strides and constexprs) of w13 (which = 0) or w2 (1) for a launch."""
    if scales is None:
        return weight, dict(stride_se=0, stride_sn=0, HAS_SCALE=False, SCALE_ROWS=1, SCALE_COLS=0, E8M0=False)
    scale, block = (scales.w13, scales.w13_block) if which == 0 else (scales.w2, scales.w2_block)
    launch = scale_launch(weight, scale, block, block_k)
    return scale, dict(launch, stride_se=scale.stride(0), HAS_SCALE=block[1] == 0)


def element_args(scales: ExpertScales | None, which: int, weight: torch.Tensor, block_k: int) -> tuple[torch.Tensor, dict]:
    """(row-scale pointer, its strides, FP4 and HAS_SCALE) of w13 (0) or w2 (1): the scales that
    multiply each weight row's sums (FP8 per-row grids, NVFP4's rows), beside `scale_args`."""
    if scales is None or not scales.fp4:
        scale, launch = scale_args(scales, which, weight, block_k)
        return scale, dict(stride_re=launch["stride_se"], stride_rn=launch["stride_sn"], FP4=False)
    rows = scales.w13_rows if which == 0 else scales.w2_rows
    assert rows is not None
    if block_k < 2 * NVFP4_GROUP:
        raise ValueError(f"NVFP4 experts need strips of at least {2 * NVFP4_GROUP} columns, got {block_k}")
    return rows, dict(stride_re=rows.stride(0), stride_rn=rows.stride(1), FP4=True, HAS_SCALE=True)


@triton.jit
def row_scales(s_base, offs_n, n_ok, stride_sn):
    """One float32 scale per weight row n (a per-row scale grid [rows, 1])."""
    return tl.load(s_base + offs_n.to(tl.int64) * stride_sn, mask=n_ok, other=0.0).to(tl.float32)

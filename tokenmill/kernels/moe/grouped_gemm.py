"""Grouped GEMMs over the expert-sorted slots (align.py): prefill and large batches.

    gate-up:  act[p]        = silu(x[token(p)] @ w13[e, :I].T) * (x[token(p)] @ w13[e, I:].T)
    down:     slot_out[s]   = weight[s] * (act[p] @ w2[e].T)       for the slot s at position p

Each program owns one BLOCK_M-row block of positions (all of one expert: the runs are padded
to BLOCK_M) and one BLOCK_N strip of the output columns. It finds its expert from the run
starts, gathers its rows of x by token (gate-up) or reads its rows of act in place (down), and
multiplies them by the expert's weight strip on the tensor cores. Gate-up accumulates the gate
and up strips side by side and applies SiLU-and-mul in float32 before its one rounding to the
activations' dtype; down scales each row by its routing weight before rounding. The grid is
fixed by the padded capacity (programs past the used blocks return at once), with the row
block varying fastest, so the blocks of one expert that read the same weight strip run
together and the strip comes from DRAM about once.

NVFP4 weights (FP4) load as [BLOCK_N, BLOCK_K / 2] bytes, decode into their even and odd element
columns (kernels/nvfp4.py) and multiply x's even and odd columns; each row's sums then take its
row scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import apply_block_scales, block_scales, interpreting, mm, next_pow2
from tokenmill.kernels.moe.align import SlotLayout
from tokenmill.kernels.moe.scales import ExpertScales, element_args, row_scales, scale_args
from tokenmill.kernels.nvfp4 import fp4_dequant


@dataclass(frozen=True)
class GroupedTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def grouped_tiles(num_slots: int, num_experts: int) -> tuple[GroupedTile, GroupedTile]:
    """(gate-up tile, down tile) for a batch of num_slots slots, from the mean rows per expert.

    Few rows per expert (decode at batch 17-256, short prefills) is a stream over the selected
    experts' weights: 16- or 32-row blocks, so little of each block is padding. Many rows is
    matmul-bound: 64 or 128 rows per block re-use each weight tile that often, 64 x 128
    accumulators (gate and up strips of 64 each, or a down strip of 128) per warp group, in
    pipelines of 3-4 stages that fit 2 programs per H200 multiprocessor (<= 96 KB shared)."""
    if interpreting():
        return GroupedTile(16, 16, 32, 1, 1), GroupedTile(16, 16, 32, 1, 1)
    rows = num_slots / num_experts
    if rows <= 32:
        block_m = 16 if rows <= 16 else 32
        return GroupedTile(block_m, 64, 64, 4, 4), GroupedTile(block_m, 128, 64, 4, 4)
    if rows <= 256:
        return GroupedTile(64, 64, 64, 4, 4), GroupedTile(64, 128, 64, 4, 4)
    return GroupedTile(128, 64, 64, 8, 3), GroupedTile(128, 128, 64, 8, 3)


@triton.jit
def _block_rows(starts_ptr, counts_ptr, sorted_ptr, num_experts, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, positions, row ok, slots) of row block pid_m; expert = num_experts past the last run."""
    block_start = pid_m * BLOCK_M
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(starts_ptr + 1 + experts, mask=experts < num_experts, other=1 << 30)
    expert = tl.sum((ends <= block_start).to(tl.int32), 0)
    safe = tl.minimum(expert, num_experts - 1)
    run_end = tl.load(starts_ptr + safe) + tl.load(counts_ptr + safe)
    positions = block_start + tl.arange(0, BLOCK_M)
    row_ok = positions < run_end  # past the last run, block_start >= every run's end
    slots = tl.load(sorted_ptr + positions, mask=row_ok, other=0)
    return expert, positions, row_ok, slots


@triton.jit
def _scaled_mm_kn(x, w, acc, s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                  E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                  IEEE: tl.constexpr):
    """acc + x @ (w [BLOCK_K, BLOCK_N] times its block scales), w widened to x's dtype: a strip in
    one scale group scales its partial product; MX groups scale w in registers (few_row_mma.scaled_mma)."""
    if SCALE_COLS >= BLOCK_K:
        s = block_scales(s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, BLOCK_K, E8M0)
        acc = acc + mm(x, w.to(x.dtype), tl.zeros(acc.shape, tl.float32), UPCAST, IEEE) * s[None, :]
    elif SCALE_COLS > 0:
        s = block_scales(s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, BLOCK_K, E8M0)
        w = tl.trans(apply_block_scales(tl.trans(w.to(tl.float32)), s, BLOCK_N, BLOCK_K, SCALE_COLS))
        acc = mm(x, w.to(x.dtype), acc, UPCAST, IEEE)
    else:
        acc = mm(x, w.to(x.dtype), acc, UPCAST, IEEE)
    return acc


@triton.jit
def _weight_ptrs(w_ptr, expert, offs_n, stride_we, stride_wn, BLOCK_K: tl.constexpr, FP4: tl.constexpr):
    """Pointers of a weight strip at column 0: [BLOCK_K, BLOCK_N] elements (read as W^T), or for FP4
    [BLOCK_N, BLOCK_K / 2] bytes."""
    base = w_ptr + expert.to(tl.int64) * stride_we
    if FP4:
        ptrs = base + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
    else:
        ptrs = base + offs_n[None, :].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[:, None]
    return ptrs


@triton.jit
def _x_ptrs(base_ptrs, BLOCK_K: tl.constexpr, FP4: tl.constexpr):
    """Pointers of the rows' strip of x at column 0 (base_ptrs [BLOCK_M, 1], one per row): every
    column, or for FP4 the even ones."""
    if FP4:
        ptrs = base_ptrs + 2 * tl.arange(0, BLOCK_K // 2)[None, :]
    else:
        ptrs = base_ptrs + tl.arange(0, BLOCK_K)[None, :]
    return ptrs


@triton.jit
def _rows_strip(x_ptrs, k0, row_ok, K, EVEN_K: tl.constexpr, FP4: tl.constexpr, BLOCK_K: tl.constexpr):
    """(the rows' strip of x at column k0, the odd columns' for FP4, else the same strip again)."""
    if FP4:
        cols = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    if FP4:
        if EVEN_K:
            xo = tl.load(x_ptrs + k0 + 1, mask=row_ok[:, None], other=0.0)
        else:
            xo = tl.load(x_ptrs + k0 + 1, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    else:
        xo = x
    return x, xo


@triton.jit
def _strip_product(acc, x, xo, w_ptrs, n_ok, s_base, offs_n, k0, K, stride_sn, EVEN_K: tl.constexpr,
                   FP4: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + the rows' strip of x (x, and xo: its odd columns for FP4) @ (the weight strip at column
    k0 times its scales)^T."""
    if FP4:
        if EVEN_K:
            w = tl.load(w_ptrs + k0 // 2, mask=n_ok[:, None], other=0)
        else:
            w = tl.load(w_ptrs + k0 // 2, mask=n_ok[:, None] & (k0 + 2 * tl.arange(0, BLOCK_K // 2) < K)[None, :],
                        other=0)
        even, odd = fp4_dequant(w, x, s_base, offs_n, n_ok, k0, K, stride_sn, BLOCK_N, BLOCK_K)
        acc = mm(xo, tl.trans(odd), mm(x, tl.trans(even), acc, UPCAST, IEEE), UPCAST, IEEE)
    else:
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs + k0, mask=n_ok[None, :] & (k0 + tl.arange(0, BLOCK_K) < K)[:, None], other=0.0)
        acc = _scaled_mm_kn(x, w, acc, s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, E8M0,
                            BLOCK_N, BLOCK_K, UPCAST, IEEE)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, starts_ptr, counts_ptr, sorted_ptr, s_ptr, r_ptr, num_experts, max_blocks, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ap, stride_se, stride_sn, stride_re, stride_rn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
    FP4: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % max_blocks
    pid_n = pid // max_blocks
    expert, positions, row_ok, slots = _block_rows(starts_ptr, counts_ptr, sorted_ptr, num_experts, pid_m,
                                                   BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    tokens = slots // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    x_ptrs = _x_ptrs(x_ptr + tokens[:, None].to(tl.int64) * stride_xt, BLOCK_K, FP4)
    gate_ptrs = _weight_ptrs(w_ptr, expert, offs_n, stride_we, stride_wn, BLOCK_K, FP4)
    up_ptrs = gate_ptrs + inter * stride_wn
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    r_base = r_ptr + expert.to(tl.int64) * stride_re
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        x, xo = _rows_strip(x_ptrs, k0, row_ok, hidden, EVEN_K, FP4, BLOCK_K)
        gate = _strip_product(gate, x, xo, gate_ptrs, n_ok, s_base, offs_n, k0, hidden, stride_sn, EVEN_K, FP4,
                              SCALE_ROWS, SCALE_COLS, E8M0, BLOCK_N, BLOCK_K, UPCAST, IEEE)
        up = _strip_product(up, x, xo, up_ptrs, n_ok, s_base, offs_n + inter, k0, hidden, stride_sn, EVEN_K, FP4,
                            SCALE_ROWS, SCALE_COLS, E8M0, BLOCK_N, BLOCK_K, UPCAST, IEEE)
    if HAS_SCALE:
        gate = gate * row_scales(r_base, offs_n, n_ok, stride_rn)[None, :]
        up = up * row_scales(r_base, offs_n + inter, n_ok, stride_rn)[None, :]
    act = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + positions[:, None].to(tl.int64) * stride_ap + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, weights_ptr, out_ptr, starts_ptr, counts_ptr, sorted_ptr, s_ptr, r_ptr, num_experts, max_blocks,
    hidden, inter, stride_ap, stride_we, stride_wn, stride_os, stride_se, stride_sn, stride_re, stride_rn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
    FP4: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % max_blocks
    pid_n = pid // max_blocks
    expert, positions, row_ok, slots = _block_rows(starts_ptr, counts_ptr, sorted_ptr, num_experts, pid_m,
                                                   BLOCK_M, BLOCK_E)
    if expert >= num_experts:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    a_ptrs = _x_ptrs(act_ptr + positions[:, None].to(tl.int64) * stride_ap, BLOCK_K, FP4)
    w_ptrs = _weight_ptrs(w_ptr, expert, offs_n, stride_we, stride_wn, BLOCK_K, FP4)
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    r_base = r_ptr + expert.to(tl.int64) * stride_re
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a, ao = _rows_strip(a_ptrs, k0, row_ok, inter, EVEN_K, FP4, BLOCK_K)
        acc = _strip_product(acc, a, ao, w_ptrs, n_ok, s_base, offs_n, k0, inter, stride_sn, EVEN_K, FP4,
                             SCALE_ROWS, SCALE_COLS, E8M0, BLOCK_N, BLOCK_K, UPCAST, IEEE)
    if HAS_SCALE:
        acc = acc * row_scales(r_base, offs_n, n_ok, stride_rn)[None, :]
    acc = acc * tl.load(weights_ptr + slots, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_os + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: SlotLayout,
    top_k: int,
    tiles: tuple[GroupedTile, GroupedTile],
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """slot_out [T * k, H]: each slot's expert output times its routing weight, in x's dtype (FP8
    or NVFP4 weights with their `scales`)."""
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    inter = two_inter // 2
    gate_up_tile, down_tile = tiles
    if gate_up_tile.block_m != layout.block_m or down_tile.block_m != layout.block_m:
        raise ValueError(f"the tiles' block_m must be the layout's {layout.block_m}")
    max_blocks = layout.max_blocks
    act = torch.empty(layout.sorted_slots.numel(), inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(topk_weights.numel(), hidden, dtype=x.dtype, device=x.device)
    common = dict(UPCAST=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
                  BLOCK_E=next_pow2(num_experts))
    t = gate_up_tile
    s13, scaling13 = scale_args(scales, 0, w13, t.block_k)
    r13, elements13 = element_args(scales, 0, w13, t.block_k)
    _gate_up_kernel[(max_blocks * triton.cdiv(inter, t.block_n),)](
        x, w13, act, layout.starts, layout.counts, layout.sorted_slots, s13, r13, num_experts, max_blocks, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=hidden % t.block_k == 0,
        num_warps=t.num_warps, num_stages=t.num_stages, **common, **dict(scaling13, **elements13),
    )
    t = down_tile
    s2, scaling2 = scale_args(scales, 1, w2, t.block_k)
    r2, elements2 = element_args(scales, 1, w2, t.block_k)
    _down_kernel[(max_blocks * triton.cdiv(hidden, t.block_n),)](
        act, w2, topk_weights, slot_out, layout.starts, layout.counts, layout.sorted_slots, s2, r2, num_experts,
        max_blocks, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), slot_out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=inter % t.block_k == 0,
        num_warps=t.num_warps, num_stages=t.num_stages, **common, **dict(scaling2, **elements2),
    )
    return slot_out

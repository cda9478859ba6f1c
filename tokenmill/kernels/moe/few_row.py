"""Few-row expert kernels for decode and small batches (at most FEW_ROWS tokens).

Decode is a stream over the selected experts' weights. Each program owns one slot (a token's
j-th choice) and one strip of output columns; of the slots that chose the same expert only the
first one's programs run, and they take every token that chose it (at most one slot per token,
so at most FEW_ROWS rows). A program streams its expert's weight strip once, as the wide
operand of the tensor-core product W_strip @ rows^T ([BLOCK_N, BLOCK_K] @ [BLOCK_K, 16], the
rows padded with zeros as in few_row_mma.py), so a step reads each selected expert's bytes
once however many tokens chose it; the other programs return at once.

    gate-up:  act[s]       = silu(x[token(s)] @ w13[e, :I].T) * (x[token(s)] @ w13[e, I:].T)
    down:     slot_out[s]  = weight[s] * (act[s] @ w2[e].T)

act and slot_out are indexed by slot. The routing weights and ids were written before the
gate-up kernel started, so the down kernel, launched as a programmatic dependent of gate-up on
sm_90+, finds its expert and reads its first weight strip before waiting for act.

Weights are in x's dtype, FP8 E4M3 with block scales, or NVFP4 (FP4: a strip is BLOCK_K / 2
bytes a row, decoded into its even and odd element columns, which multiply x's even and odd
columns; kernels/nvfp4.py), each row's sums then times its row scale where the weight has one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenmill.kernels._common import dependent_launch, interpreting, launch_next, mm, next_pow2
from tokenmill.kernels.few_row_mma import scaled_mma
from tokenmill.kernels.gemv import GemvTile
from tokenmill.kernels.moe.scales import ExpertScales, element_args, row_scales, scale_args
from tokenmill.kernels.nvfp4 import fp4_dequant

FEW_ROWS = 16  # rows one program multiplies (the MMA's narrow side): tokens of a few-row call at most


def few_row_tiles() -> tuple[GemvTile, GemvTile]:
    """(gate-up, down) tiles. Gate-up: 32 gate + 32 up rows of w13 per program, down: 64 rows of
    w2, each in 128-wide strips of K, three stages deep: ~60 KB of shared memory, so three
    programs fit an H200 multiprocessor and batch-1 decode (k * I / 32 gate-up and k * H / 64
    down programs: 192 and 256 for 8 experts of Qwen3-30B-A3B) runs in one wave with ~32 KB
    in flight per program."""
    if interpreting():
        return GemvTile(16, 32, 1, 1), GemvTile(16, 32, 1, 1)
    return GemvTile(32, 128, 4, 3), GemvTile(64, 128, 4, 3)


@triton.jit
def _expert_rows(ids_ptr, slot, num_slots, TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
    """(expert, leads, slots [ROWS], row ok [ROWS]) of the program of `slot`: leads is whether
    `slot` is the first slot of its expert; the slots are every slot of that expert."""
    offs = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    expert = tl.load(ids_ptr + slot)
    mine = ids == expert
    leads = tl.sum((mine & (offs < slot)).to(tl.int32), 0) == 0
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    row = tl.arange(0, ROWS)
    pick = mine[None, :] & (rank[None, :] == row[:, None])  # [ROWS, BLOCK_S]
    slots = tl.sum(tl.where(pick, offs[None, :], 0), 1)
    row_ok = tl.sum(pick.to(tl.int32), 1) > 0
    return expert, leads, slots, row_ok


@triton.jit
def _strip_columns(BLOCK_K: tl.constexpr, FP4: tl.constexpr):
    """(storage columns of a weight strip, the x column of each): BLOCK_K elements, or BLOCK_K / 2
    bytes whose x columns are the even ones (the odd ones follow each)."""
    if FP4:
        offs = tl.arange(0, BLOCK_K // 2)
        x_cols = 2 * offs
    else:
        offs = tl.arange(0, BLOCK_K)
        x_cols = offs
    return offs, x_cols


@triton.jit
def _weight_strip(w_ptrs, k0, n_ok, x_cols, K, EVEN_K: tl.constexpr, FP4: tl.constexpr):
    """The weight strip at element column k0 ([BLOCK_N, storage columns])."""
    if FP4:
        ptrs = w_ptrs + k0 // 2
    else:
        ptrs = w_ptrs + k0
    if EVEN_K:
        w = tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(ptrs, mask=n_ok[:, None] & (k0 + x_cols < K)[None, :], other=0.0)
    return w


@triton.jit
def _rows_strip(xt_ptrs, k0, row_ok, x_cols, K, EVEN_K: tl.constexpr, FP4: tl.constexpr):
    """(x^T strip [x columns, ROWS], the odd columns' for FP4, else the same strip again)."""
    if EVEN_K:
        xt = tl.load(xt_ptrs + k0, mask=row_ok[None, :], other=0.0)
    else:
        xt = tl.load(xt_ptrs + k0, mask=row_ok[None, :] & (k0 + x_cols < K)[:, None], other=0.0)
    if FP4:
        if EVEN_K:
            xo = tl.load(xt_ptrs + k0 + 1, mask=row_ok[None, :], other=0.0)
        else:
            xo = tl.load(xt_ptrs + k0 + 1, mask=row_ok[None, :] & (k0 + x_cols < K)[:, None], other=0.0)
    else:
        xo = xt
    return xt, xo


@triton.jit
def _strip_product(acc, w, xt, xo, s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS: tl.constexpr,
                   SCALE_COLS: tl.constexpr, E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, IEEE: tl.constexpr, FP4: tl.constexpr):
    """acc + (weight strip w times its block scales) @ the rows' strip of x^T."""
    if FP4:
        even, odd = fp4_dequant(w, xt, s_base, offs_n, n_ok, k0, K, stride_sn, BLOCK_N, BLOCK_K)
        acc = mm(odd, xo, mm(even, xt, acc, UPCAST, IEEE), UPCAST, IEEE)
    else:
        acc = scaled_mma(w, xt, acc, s_base, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS, SCALE_COLS, E8M0,
                         BLOCK_N, BLOCK_K, UPCAST, IEEE)
    return acc


@triton.jit
def _few_row_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, s_ptr, r_ptr, num_slots, hidden, inter, stride_xt, stride_we, stride_wn,
    stride_as, stride_se, stride_sn, stride_re, stride_rn,
    TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
    FP4: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    expert, leads, slots, row_ok = _expert_rows(ids_ptr, tl.program_id(0), num_slots, TOP_K, BLOCK_S, ROWS)
    if not leads:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k, x_cols = _strip_columns(BLOCK_K, FP4)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    xt_ptrs = x_ptr + (slots // TOP_K)[None, :].to(tl.int64) * stride_xt + x_cols[:, None]  # x^T: [BLOCK_K, ROWS]
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    r_base = r_ptr + expert.to(tl.int64) * stride_re
    gate = tl.zeros([BLOCK_N, ROWS], tl.float32)
    up = tl.zeros([BLOCK_N, ROWS], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        wg = _weight_strip(gate_ptrs, k0, n_ok, x_cols, hidden, EVEN_K, FP4)
        wu = _weight_strip(up_ptrs, k0, n_ok, x_cols, hidden, EVEN_K, FP4)
        xt, xo = _rows_strip(xt_ptrs, k0, row_ok, x_cols, hidden, EVEN_K, FP4)
        gate = _strip_product(gate, wg, xt, xo, s_base, offs_n, n_ok, k0, hidden, stride_sn, SCALE_ROWS, SCALE_COLS,
                              E8M0, BLOCK_N, BLOCK_K, UPCAST, IEEE, FP4)
        up = _strip_product(up, wu, xt, xo, s_base, offs_n + inter, n_ok, k0, hidden, stride_sn, SCALE_ROWS,
                            SCALE_COLS, E8M0, BLOCK_N, BLOCK_K, UPCAST, IEEE, FP4)
    if HAS_SCALE:
        gate = gate * row_scales(r_base, offs_n, n_ok, stride_rn)[:, None]
        up = up * row_scales(r_base, offs_n + inter, n_ok, stride_rn)[:, None]
    act = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + slots[None, :].to(tl.int64) * stride_as + offs_n[:, None]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def _few_row_down_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, s_ptr, r_ptr, num_slots, hidden, inter, stride_as, stride_we,
    stride_wn, stride_os, stride_se, stride_sn, stride_re, stride_rn,
    TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, E8M0: tl.constexpr,
    FP4: tl.constexpr,
):
    expert, leads, slots, row_ok = _expert_rows(ids_ptr, tl.program_id(0), num_slots, TOP_K, BLOCK_S, ROWS)
    if not leads:  # writes nothing, so it need not wait for gate-up
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k, x_cols = _strip_columns(BLOCK_K, FP4)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    at_ptrs = act_ptr + slots[None, :].to(tl.int64) * stride_as + x_cols[:, None]  # act^T: [BLOCK_K, ROWS]
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    r_base = r_ptr + expert.to(tl.int64) * stride_re
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    k_start = 0
    if PDL:
        # The weights never depend on gate-up: the first strip is read before waiting for act.
        w = _weight_strip(w_ptrs, 0, n_ok, x_cols, inter, EVEN_K, FP4)
        gdc_wait()
        at, ao = _rows_strip(at_ptrs, 0, row_ok, x_cols, inter, False, FP4)
        acc = _strip_product(acc, w, at, ao, s_base, offs_n, n_ok, 0, inter, stride_sn, SCALE_ROWS, SCALE_COLS, E8M0,
                             BLOCK_N, BLOCK_K, UPCAST, IEEE, FP4)
        k_start = BLOCK_K
    for k0 in range(k_start, inter, BLOCK_K):
        w = _weight_strip(w_ptrs, k0, n_ok, x_cols, inter, EVEN_K, FP4)
        at, ao = _rows_strip(at_ptrs, k0, row_ok, x_cols, inter, EVEN_K, FP4)
        acc = _strip_product(acc, w, at, ao, s_base, offs_n, n_ok, k0, inter, stride_sn, SCALE_ROWS, SCALE_COLS, E8M0,
                             BLOCK_N, BLOCK_K, UPCAST, IEEE, FP4)
    if HAS_SCALE:
        acc = acc * row_scales(r_base, offs_n, n_ok, stride_rn)[:, None]
    acc = acc * tl.load(weights_ptr + slots, mask=row_ok, other=0.0)[None, :]
    out_ptrs = out_ptr + slots[None, :].to(tl.int64) * stride_os + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


def few_row_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: tuple[GemvTile, GemvTile] | None = None,
    pdl: bool | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """slot_out [T * k, H] for T <= FEW_ROWS tokens: each slot's expert output times its routing
    weight, in x's dtype; FP8 or NVFP4 weights with their `scales`. pdl (default: where the device
    has it) launches down as a programmatic dependent of gate-up."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens > FEW_ROWS:
        raise ValueError(f"few_row_experts takes at most {FEW_ROWS} tokens, got {num_tokens}")
    two_inter, hidden = w13.shape[1], x.shape[1]
    inter = two_inter // 2
    num_slots = num_tokens * top_k
    gate_up_tile, down_tile = tiles or few_row_tiles()
    pdl = dependent_launch(x.device) if pdl is None else pdl
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    common = dict(TOP_K=top_k, BLOCK_S=next_pow2(num_slots), ROWS=FEW_ROWS,
                  UPCAST=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32)
    t = gate_up_tile
    s13, scaling13 = scale_args(scales, 0, w13, t.block_k)
    r13, elements13 = element_args(scales, 0, w13, t.block_k)
    _few_row_gate_up_kernel[(num_slots, triton.cdiv(inter, t.block_n))](
        x, w13, topk_ids, act, s13, r13, num_slots, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=hidden % t.block_k == 0, LAUNCH_NEXT=pdl,
        num_warps=t.num_warps, num_stages=t.num_stages, **common, **dict(scaling13, **elements13),
    )
    t = down_tile
    s2, scaling2 = scale_args(scales, 1, w2, t.block_k)
    r2, elements2 = element_args(scales, 1, w2, t.block_k)
    _few_row_down_kernel[(num_slots, triton.cdiv(hidden, t.block_n))](
        act, w2, topk_ids, topk_weights, slot_out, s2, r2, num_slots, hidden, inter, act.stride(0), w2.stride(0),
        w2.stride(1), slot_out.stride(0),
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=inter % t.block_k == 0, PDL=pdl,
        num_warps=t.num_warps, num_stages=t.num_stages, launch_pdl=pdl, **common, **dict(scaling2, **elements2),
    )
    return slot_out

"""Chunked gated delta rule (prefill, chunked prefill resuming from a slot), two Triton kernels
mirroring gated_delta_ref.gated_delta_rule_chunked_ref:

1. _chunk_prepare_kernel, one program per (chunk, value head), all chunks in parallel: the
   cumulative log-decay, the UT transform T = (I + strict_lower(beta_i k_i . k_j decay_ij))^-1
   (forward substitution in blocks of 16, then a block merge), the WY factors w = T (beta k e^gcum) and u = T (beta v), and the
   masked intra-chunk attention q_i . k_j decay_ij. With a per-channel gate (KDA) the decay sits
   inside the sum over key channels, so those two matrices are built a column at a time, every
   exponent <= 0 (no overflow however strong the decay).
2. _chunk_scan_kernel, one program per (request, value head, value-column tile): the state tile
   stays in registers across the request's chunks: v_new = u - w S; o = (q e^gcum) S + A_qk v_new;
   S = e^gcum_last S + (k e^(gcum_last - gcum))^T v_new; checkpoints at chunk ends.

The chunk plan (no chunk crosses a request or a checkpoint) is made on the host: prefill runs
eagerly. Intermediates go through global memory in the inputs' dtype (w, u) and float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import and_flag, dot_width, interpreting, mm
from tokenmill.kernels.gated_delta_ref import CHUNK, plan_chunks

# On a GPU: value columns per scan program (narrow: more programs for one long request), and
# warps per program (with fewer, the float32 tiles of the UT transform and the scan spill out of
# sm_90's registers).
CHUNK_BLOCK_V = 32
PREPARE_WARPS = 16
SCAN_WARPS = 8


@triton.jit
def _unit_rows(x_ptr, rows, cols, row_ok, NORM: tl.constexpr, DK: tl.constexpr):
    """Rows of q or k as float32, L2-normalised when NORM."""
    x = tl.load(x_ptr + rows[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < DK), other=0.0)
    x = x.to(tl.float32)
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _unit_lower_inverse(a, idx, CHUNK_SIZE: tl.constexpr):
    """(I + a)^-1 for a strictly lower triangular [CHUNK, CHUNK] float32 a. The diagonal blocks of
    SUB rows are inverted by forward substitution, one row of every block per step (row i of
    D^-1 is e_i - sum_{j < i} a_ij (D^-1)_j); then with M = D^-1 N (N: a below the diagonal
    blocks, so M^4 = 0 for at most four blocks), (I + a)^-1 = (I - M)(I + M^2) D^-1, exact."""
    SUB: tl.constexpr = 16 if CHUNK_SIZE > 16 else CHUNK_SIZE
    tl.static_assert(CHUNK_SIZE <= 4 * SUB)
    same_block = (idx[:, None] // SUB) == (idx[None, :] // SUB)
    diagonal = tl.where(same_block, a, 0.0)
    eye = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    d_inv = eye
    for r in range(1, SUB):
        step_rows = (idx % SUB) == r
        a_rows = tl.sum(tl.where(step_rows[:, None], diagonal, 0.0), 0)  # blocks' rows side by side
        row = tl.where(step_rows, 1.0, 0.0) - tl.sum(a_rows[:, None] * d_inv, 0)
        d_inv = tl.where(step_rows[:, None] & same_block, row[None, :], d_inv)
    zeros = tl.zeros([CHUNK_SIZE, CHUNK_SIZE], tl.float32)
    m = tl.dot(d_inv, tl.where(same_block, 0.0, a), zeros, input_precision="ieee")
    m2 = tl.dot(m, m, zeros, input_precision="ieee")
    p = tl.dot(eye - m, m2, eye - m, input_precision="ieee")
    return tl.dot(p, d_inv, zeros, input_precision="ieee")


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, chunk_starts_ptr, gcum_ptr, w_ptr, u_ptr, aqk_ptr, scale,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
    CHUNK_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr, NORM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    start = tl.load(chunk_starts_ptr + chunk)
    length = tl.load(chunk_starts_ptr + chunk + 1) - start
    idx = tl.arange(0, CHUNK_SIZE)
    row_ok = idx < length
    tok = (start + idx).to(tl.int64)
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    dt = q_ptr.dtype.element_ty

    k = _unit_rows(k_ptr + key_head * stride_qh, tok * stride_qt, dk, row_ok, NORM, DK)
    q = _unit_rows(q_ptr + key_head * stride_qh, tok * stride_qt, dk, row_ok, NORM, DK) * scale
    beta = tl.load(beta_ptr + tok * stride_bt + head, mask=row_ok, other=0.0).to(tl.float32)
    lower = idx[:, None] >= idx[None, :]
    if PER_CHANNEL:
        g_rows = g_ptr + tok[:, None] * stride_gt + head * stride_gh + dk[None, :]
        gcum = tl.cumsum(tl.load(g_rows, mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0), 0)
        gcum_rows = gcum_ptr + tok[:, None] * stride_gt + head * stride_gh + dk[None, :]
        tl.store(gcum_rows, gcum, mask=row_ok[:, None] & (dk[None, :] < DK))
        tl.debug_barrier()  # the column loop reads gcum back, one row at a time
        kk = tl.zeros([CHUNK_SIZE, CHUNK_SIZE], tl.float32)
        qk = tl.zeros([CHUNK_SIZE, CHUNK_SIZE], tl.float32)
        for j in range(0, length):
            row_j = (start + j).to(tl.int64)
            k_j = tl.load(k_ptr + row_j * stride_qt + key_head * stride_qh + dk[None, :], mask=dk[None, :] < DK,
                          other=0.0).to(tl.float32)
            if NORM:
                k_j = k_j * tl.rsqrt(tl.sum(k_j * k_j, 1) + 1e-6)[:, None]
            g_j = tl.load(gcum_ptr + row_j * stride_gt + head * stride_gh + dk[None, :], mask=dk[None, :] < DK, other=0.0)
            decayed = k_j * tl.exp(tl.minimum(gcum - g_j, 0.0))  # rows i >= j: exponent <= 0
            col = idx[None, :] == j
            kk = tl.where(col, tl.sum(k * decayed, 1)[:, None], kk)
            qk = tl.where(col, tl.sum(q * decayed, 1)[:, None], qk)
    else:
        gcum = tl.cumsum(tl.load(g_ptr + tok * stride_gt + head, mask=row_ok, other=0.0), 0)
        tl.store(gcum_ptr + tok * stride_gt + head, gcum, mask=row_ok)
        decay = tl.exp(tl.minimum(gcum[:, None] - gcum[None, :], 0.0))
        kk = mm(k.to(dt), tl.trans(k.to(dt)), tl.zeros([CHUNK_SIZE, CHUNK_SIZE], tl.float32), UPCAST, IEEE) * decay
        qk = mm(q.to(dt), tl.trans(k.to(dt)), tl.zeros([CHUNK_SIZE, CHUNK_SIZE], tl.float32), UPCAST, IEEE) * decay
    tl.store(aqk_ptr + tok[:, None] * stride_at + head * stride_ah + idx[None, :], tl.where(lower, qk, 0.0),
             mask=row_ok[:, None])
    t_dt = _unit_lower_inverse(tl.where(idx[:, None] > idx[None, :], beta[:, None] * kk, 0.0), idx, CHUNK_SIZE).to(dt)

    # k and its decays again, from memory: fewer [CHUNK, Dk] tiles stay live through the inverse.
    k = _unit_rows(k_ptr + key_head * stride_qh, tok * stride_qt, dk, row_ok, NORM, DK)
    if PER_CHANNEL:
        k_decayed = k * tl.exp(tl.load(gcum_rows, mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0))
    else:
        k_decayed = k * tl.exp(gcum)[:, None]
    w = mm(t_dt, (beta[:, None] * k_decayed).to(dt), tl.zeros([CHUNK_SIZE, DK_P], tl.float32), UPCAST, IEEE)
    tl.store(w_ptr + tok[:, None] * stride_wt + head * stride_wh + dk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dk[None, :] < DK))
    v = tl.load(v_ptr + tok[:, None] * stride_vt + head * stride_vh + dv[None, :],
                mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
    u = mm(t_dt, (beta[:, None] * v).to(dt), tl.zeros([CHUNK_SIZE, DV_P], tl.float32), UPCAST, IEEE)
    tl.store(u_ptr + tok[:, None] * stride_ut + head * stride_uh + dv[None, :], u.to(u_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, gcum_ptr, w_ptr, u_ptr, aqk_ptr, out_ptr, state_ptr, slots_ptr, has_initial_ptr, checkpoint_ptr,
    chunk_starts_ptr, chunk_offsets_ptr, scale,
    stride_qt, stride_qh, stride_gt, stride_gh, stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah,
    stride_ot, stride_oh, stride_ss, stride_sh, stride_sk,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, BV: tl.constexpr,
    CHUNK_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr, NORM: tl.constexpr, HAS_CHECKPOINTS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, DK_P)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    idx = tl.arange(0, CHUNK_SIZE)
    dt = q_ptr.dtype.element_ty
    tile_ok = (dk[:, None] < DK) & (dv[None, :] < DV)
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    slot = tl.load(slots_ptr + req).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + req) != 0
    s = tl.load(state_ptr + slot * stride_ss + tile, mask=and_flag(tile_ok, has_initial), other=0.0).to(tl.float32)

    for c in range(tl.load(chunk_offsets_ptr + req), tl.load(chunk_offsets_ptr + req + 1)):
        start = tl.load(chunk_starts_ptr + c)
        end = tl.load(chunk_starts_ptr + c + 1)
        row_ok = idx < end - start
        tok = (start + idx).to(tl.int64)
        q = _unit_rows(q_ptr + key_head * stride_qh, tok * stride_qt, dk, row_ok, NORM, DK) * scale
        k = _unit_rows(k_ptr + key_head * stride_qh, tok * stride_qt, dk, row_ok, NORM, DK)
        w = tl.load(w_ptr + tok[:, None] * stride_wt + head * stride_wh + dk[None, :],
                    mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
        u = tl.load(u_ptr + tok[:, None] * stride_ut + head * stride_uh + dv[None, :],
                    mask=row_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        aqk = tl.load(aqk_ptr + tok[:, None] * stride_at + head * stride_ah + idx[None, :], mask=row_ok[:, None], other=0.0)
        last = (end - 1).to(tl.int64)
        if PER_CHANNEL:
            gcum = tl.load(gcum_ptr + tok[:, None] * stride_gt + head * stride_gh + dk[None, :],
                           mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)
            g_last = tl.load(gcum_ptr + last * stride_gt + head * stride_gh + dk, mask=dk < DK, other=0.0)
            q_decayed = q * tl.exp(gcum)
            k_decayed = k * tl.exp(g_last[None, :] - gcum)
            s_decay = tl.exp(g_last)[:, None]
        else:
            gcum = tl.load(gcum_ptr + tok * stride_gt + head, mask=row_ok, other=0.0)
            g_last = tl.load(gcum_ptr + last * stride_gt + head)
            q_decayed = q * tl.exp(gcum)[:, None]
            k_decayed = k * tl.exp(g_last - gcum)[:, None]
            s_decay = tl.exp(g_last)
        s_dt = s.to(dt)
        v_new = u - mm(w.to(dt), s_dt, tl.zeros([CHUNK_SIZE, BV], tl.float32), UPCAST, IEEE)
        o = mm(q_decayed.to(dt), s_dt, tl.zeros([CHUNK_SIZE, BV], tl.float32), UPCAST, IEEE)
        o = mm(aqk.to(dt), v_new.to(dt), o, UPCAST, IEEE)
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))
        s = mm(tl.trans(k_decayed.to(dt)), v_new.to(dt), s * s_decay, UPCAST, IEEE)
        if HAS_CHECKPOINTS:
            checkpoint = tl.load(checkpoint_ptr + last).to(tl.int64)
            tl.store(state_ptr + checkpoint * stride_ss + tile, s.to(state_ptr.dtype.element_ty),
                     mask=and_flag(tile_ok, checkpoint >= 0))
    tl.store(state_ptr + slot * stride_ss + tile, s.to(state_ptr.dtype.element_ty), mask=tile_ok)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True, checkpoint_slots: torch.Tensor | None = None,
    chunk_size: int = CHUNK, block_v: int | None = None, num_warps: int | None = None,
    prepare_warps: int | None = None,
) -> torch.Tensor:
    """As gated_delta.gated_delta_rule, whose kernel_inputs prepares the arguments; reads
    cu_seqlens and the checkpoints on the host. block_v / num_warps: the scan's tile,
    prepare_warps the first kernel's warps (None: chosen here)."""
    num_tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    out = torch.empty_like(v)
    if num_tokens == 0:
        return out
    g = g.contiguous()
    marks = [] if checkpoint_slots is None else torch.nonzero(checkpoint_slots >= 0).flatten().tolist()
    plan = plan_chunks(cu_seqlens.tolist(), marks, chunk_size)
    device = q.device
    chunk_starts = torch.tensor(plan.chunk_starts, dtype=torch.int32, device=device)
    chunk_offsets = torch.tensor(plan.chunk_offsets, dtype=torch.int32, device=device)
    per_channel = g.dim() == 3
    gcum = torch.empty_like(g)
    w = torch.empty(num_tokens, value_heads, key_dim, dtype=q.dtype, device=device)
    u = torch.empty(num_tokens, value_heads, value_dim, dtype=q.dtype, device=device)
    aqk = torch.empty(num_tokens, value_heads, chunk_size, dtype=torch.float32, device=device)
    on_gpu = device.type == "cuda" and not interpreting()
    upcast = interpreting() and q.dtype == torch.bfloat16
    ieee = q.dtype == torch.float32
    dk_p, dv_p = dot_width(key_dim), dot_width(value_dim)
    stride_gh = g.stride(1)
    _chunk_prepare_kernel[(plan.num_chunks, value_heads)](
        q, k, v, g, beta, chunk_starts, gcum, w, u, aqk, scale,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), stride_gh, beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), aqk.stride(0), aqk.stride(1),
        GROUP=value_heads // key_heads, DK=key_dim, DV=value_dim, DK_P=dk_p, DV_P=dv_p, CHUNK_SIZE=chunk_size,
        PER_CHANNEL=per_channel, NORM=use_qk_l2norm, UPCAST=upcast, IEEE=ieee,
        num_warps=prepare_warps or (PREPARE_WARPS if on_gpu else 1), num_stages=1,
    )
    block_v = block_v or min(dv_p, CHUNK_BLOCK_V if on_gpu else 8)
    has_checkpoints = checkpoint_slots is not None
    _chunk_scan_kernel[(slots.shape[0], value_heads, triton.cdiv(value_dim, block_v))](
        q, k, gcum, w, u, aqk, out, state, slots, has_initial_state.view(torch.int8),
        checkpoint_slots if has_checkpoints else slots, chunk_starts, chunk_offsets, scale,
        q.stride(0), q.stride(1), g.stride(0), stride_gh, w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        aqk.stride(0), aqk.stride(1), out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        GROUP=value_heads // key_heads, DK=key_dim, DV=value_dim, DK_P=dk_p, BV=block_v, CHUNK_SIZE=chunk_size,
        PER_CHANNEL=per_channel, NORM=use_qk_l2norm, HAS_CHECKPOINTS=has_checkpoints, UPCAST=upcast, IEEE=ieee,
        num_warps=num_warps or (SCAN_WARPS if on_gpu else 1), num_stages=2 if on_gpu else 1,
    )
    return out

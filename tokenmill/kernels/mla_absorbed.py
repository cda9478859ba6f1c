"""Absorbed MLA attention over the paged latent cache: decode and speculative verification (any
query length, causal among a request's query tokens), with split-KV and an exact merge.

The queries arrive absorbed: q_latent = q_nope folded through W_UK (per head, kv_lora_rank
wide) and the rotated q_pe. Every head attends to the same single "head" of the cache (MQA):
key = latent || k_pe, value = latent; the output is [T, H, kv_lora_rank] (W_UV comes after).
Reference: tokenmill.layers.attention.mla_ref.absorbed_attention_ref.

A program owns one query tile (BLOCK_Q consecutive query tokens of one request) times one head
tile (BLOCK_H heads), so each latent tile it reads serves BLOCK_Q * BLOCK_H rows; the row
layout is token-major, row r = (token r // BLOCK_H, head r % BLOCK_H). With every head of a
request in one head tile, the latent cache is read once per query tile. The value is the
key's first kv_lora_rank columns: the tile loaded for QK^T is reused for PV.

Query tiles are numbered as in paged_attention.py (request i owns tile ids
[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1), or its token ids when BLOCK_Q == 1), so a
launch needs host-side sizes only. With num_splits > 1 each tile's KV range is cut into runs
of whole KV tiles (at least MIN_SPLIT_TILES each); every split writes a normalised partial
output and its log2-sum-exp (an empty one only its -inf lse) and `_merge_kernel` combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels._common import mm
from tokenmill.kernels.paged_attention import _find_request, _online_softmax_step


@triton.jit
def _latent_tiles(
    acc, m_i, l_i, q_lat, q_pe, cache_ptr, bt_row, q_pos, kv_end, t_lo, t_hi,
    stride_cb, stride_ct, qk_scale,
    LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_P: tl.constexpr, ROPE_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Online softmax over latent tiles t_lo .. t_hi - 1. Without CAUSAL_MASK every key of these
    tiles must be visible to every row (the caller guarantees it)."""
    offs_l = tl.arange(0, LATENT_P)
    offs_r = tl.arange(0, ROPE_P)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if CAUSAL_MASK:
            n_ok = offs_n < kv_end
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        else:
            n_ok = offs_n >= 0
            page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        row = cache_ptr + page[:, None] * stride_cb + (offs_n % PAGE)[:, None] * stride_ct
        if LATENT_P == LATENT and ROPE_P == ROPE and not CAUSAL_MASK:
            lat = tl.load(row + offs_l[None, :])
            pe = tl.load(row + LATENT + offs_r[None, :])
        else:
            lat = tl.load(row + offs_l[None, :], mask=n_ok[:, None] & (offs_l[None, :] < LATENT), other=0.0)
            pe = tl.load(row + LATENT + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)
        lat = lat.to(q_lat.dtype)
        s = mm(q_lat, tl.trans(lat), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, IEEE)
        s = mm(q_pe, tl.trans(pe.to(q_pe.dtype)), s, UPCAST, IEEE)
        if CAUSAL_MASK:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        else:
            visible = 0  # unread
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s * qk_scale, lat, visible, CAUSAL_MASK, UPCAST, IEEE)
    return acc, m_i, l_i


@triton.jit
def _mla_absorbed_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_lat_ptr, q_pe_ptr, cache_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_requests, num_heads, num_splits, qk_scale, v_scale,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_bt,
    LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_P: tl.constexpr, ROPE_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, F16_DOT: tl.constexpr,
):
    # Highest tile ids first: in a long causal query run the last tiles do the most work.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(qsl_ptr, num_requests, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    first_tile = q_start if BLOCK_Q == 1 else q_start // BLOCK_Q + req
    q_tile_start = (tile - first_tile) * BLOCK_Q
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # position of the request's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile_start + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_len) & (head < num_heads)

    kv_end = ctx_start + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    # Tiles below this one hold only keys every row of the tile may see.
    full_tiles = (ctx_start + q_tile_start + 1) // BLOCK_N
    t_lo = 0
    t_hi = num_tiles
    if SPLIT:
        per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_SPLIT_TILES)
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, num_tiles)
        part = ((q_start + tok) * num_heads + head) * num_splits + split
        if t_lo >= t_hi:
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    offs_l = tl.arange(0, LATENT_P)
    offs_r = tl.arange(0, ROPE_P)
    # Head-major views ([H, T, kv_lora_rank] storage) put heads 2**31 elements apart at long T.
    q_rows = (q_start + tok).to(tl.int64)[:, None]
    heads = head.to(tl.int64)[:, None]
    q_lat = tl.load(q_lat_ptr + q_rows * stride_qlt + heads * stride_qlh + offs_l[None, :],
                    mask=row_ok[:, None] & (offs_l[None, :] < LATENT), other=0.0)
    q_pe = tl.load(q_pe_ptr + q_rows * stride_qpt + heads * stride_qph + offs_r[None, :],
                   mask=row_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    if F16_DOT:
        # An FP8 cache widens to fp16 in one instruction per pair (to bf16 it takes three); q is
        # scaled first so that it stays inside fp16's range, which holds it more finely than bf16.
        q_lat = (q_lat.to(tl.float32) * qk_scale).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_P], tl.float32)
    bt_row = block_tables_ptr + req * stride_bt
    q_pos = ctx_start + tok
    acc, m_i, l_i = _latent_tiles(
        acc, m_i, l_i, q_lat, q_pe, cache_ptr, bt_row, q_pos, kv_end, t_lo, tl.minimum(t_hi, full_tiles),
        stride_cb, stride_ct, qk_scale, LATENT, ROPE, LATENT_P, ROPE_P, BLOCK_M, BLOCK_N, PAGE, False, UPCAST, IEEE,
    )
    acc, m_i, l_i = _latent_tiles(
        acc, m_i, l_i, q_lat, q_pe, cache_ptr, bt_row, q_pos, kv_end, tl.maximum(t_lo, full_tiles), t_hi,
        stride_cb, stride_ct, qk_scale, LATENT, ROPE, LATENT_P, ROPE_P, BLOCK_M, BLOCK_N, PAGE, True, UPCAST, IEEE,
    )

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    store_mask = row_ok[:, None] & (offs_l[None, :] < LATENT)
    if SPLIT:
        lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(part_out_ptr + part.to(tl.int64)[:, None] * LATENT + offs_l[None, :], out, mask=store_mask)
    else:
        o_ptrs = out_ptr + q_rows * stride_ot + heads * stride_oh + offs_l[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, num_requests, num_heads, num_splits, stride_ot, stride_oh,
    LATENT: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr,
):
    """out[tok, head, d-block] = the lse-weighted mean of the splits' partial outputs."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_requests):  # a padding row: no request wrote partials for it
        return
    base = (tok * num_heads + head) * num_splits
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    denom = tl.sum(w, 0)
    # An empty split wrote only its -inf lse; its partial output is never read.
    mask = (s_ok & (lse > float("-inf")))[:, None] & (offs_d[None, :] < LATENT)
    parts = tl.load(part_out_ptr + (base + offs_s).to(tl.int64)[:, None] * LATENT + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < LATENT)

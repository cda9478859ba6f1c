"""Causal GQA attention over the paged KV cache: one kernel for prefill, chunked prefill, decode
and any mix of them, with optional split-KV (flash-decoding) and a log-sum-exp merge.

A program owns one *query tile* (BLOCK_Q consecutive query tokens of one request) for one KV
head, times all GROUP query heads sharing that KV head, so each KV tile it reads serves
BLOCK_Q * GROUP rows. Rows are laid out token-major: row r = (token r // GROUP_P, head r % GROUP_P).

Query tiles are numbered without a host-built map: request i owns tile ids
[qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1) (some may be empty), or, when BLOCK_Q == 1,
exactly its token ids qsl[i] .. qsl[i+1] - 1. A binary search over query_start_loc finds the
request, so the launch needs only host-side sizes (T, B) and never reads device memory.

With num_splits > 1 the KV range of every tile is cut into up to num_splits runs of whole KV
tiles (at least MIN_SPLIT_TILES each); each writes a normalised partial output and its
log2-sum-exp, an empty run only its -inf lse, and `_merge_kernel` combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels._common import launch_next, mm

LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, num_requests, tile, BLOCK_Q: tl.constexpr):
    """The largest request i whose first tile id is <= tile."""
    lo = 0
    hi = num_requests - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q != 1:
            first = first // BLOCK_Q + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, visible, MASKED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One tile of keys into the running (acc, m_i, l_i) of the rows: s [BLOCK_M, BLOCK_N] their
    scores (scaled, log2 domain), v [BLOCK_N, D] their values (the dtype p is multiplied in). With
    MASKED, only keys where `visible` (broadcastable to s) holds count."""
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mm(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, IEEE)
    return acc, m_new, l_i


@triton.jit
def _request_tile(qsl_ptr, num_requests, tile, BLOCK: tl.constexpr):
    """For a grid of tokens // BLOCK + requests tiles, request i's tiles numbered from
    query_start_loc[i] // BLOCK + i: (request, its first row, its row count, this tile's first
    row within it; past the count for a spare tile)."""
    req = _find_request(qsl_ptr, num_requests, tile, BLOCK)
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    return req, start, length, (tile - start // BLOCK - req) * BLOCK


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, lo_pos, kv_end, t_lo, t_hi, offs_d,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, CAUSAL_MASK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Online softmax over KV tiles t_lo .. t_hi - 1: with CAUSAL_MASK, row r sees keys up to
    q_pos[r] (and from lo_pos[r] with a WINDOW); without it every key of these tiles must be
    visible to every row (the caller guarantees it)."""
    d_ok = offs_d[None, :] < HEAD_DIM
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if CAUSAL_MASK:
            n_ok = offs_n < kv_end
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            kv_mask = n_ok[:, None] & d_ok
        else:
            page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
            kv_mask = d_ok
        row = (offs_n % PAGE)[:, None]
        k_ptrs = k_base + page[:, None] * stride_kb + row * stride_kt + offs_d[None, :]
        v_ptrs = v_base + page[:, None] * stride_vb + row * stride_vt + offs_d[None, :]
        if BLOCK_D == HEAD_DIM and not CAUSAL_MASK:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, IEEE) * qk_scale
        if CAUSAL_MASK:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] >= lo_pos[:, None])
        else:
            visible = 0  # unread
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v.to(q.dtype), visible, CAUSAL_MASK, UPCAST, IEEE)
    return acc, m_i, l_i


@triton.jit
def _split_range(num_tiles, num_splits, split, MIN_SPLIT_TILES: tl.constexpr):
    """(first, end) tile of a split: at least MIN_SPLIT_TILES per split, so short contexts leave the
    later splits empty (a graph captured with many splits stays cheap on short requests)."""
    per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_SPLIT_TILES)
    first = split * per_split
    return first, tl.minimum(first + per_split, num_tiles)


@triton.jit
def _load_rows(q_ptr, token, head, row_ok, offs_d, stride_qt, stride_qh, qk_scale,
               HEAD_DIM: tl.constexpr, F16_DOT: tl.constexpr):
    """(q of each row (token, head), the softmax scale to use with it)."""
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if F16_DOT:
        # FP8 keys and values widen to fp16 in one instruction per pair (to bf16 it takes three,
        # and the kernel is bound by instructions, not bytes). q is scaled first so that it
        # stays inside fp16's range; fp16 holds it, and p, more finely than bf16 does.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    return q, qk_scale


@triton.jit
def _store_rows(acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, part, token, head, row_ok, offs_d,
                stride_ot, stride_oh, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """The normalised output of each row; with SPLIT, its partial output and log2-sum-exp at `part`."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    store_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if SPLIT:
        tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
    else:
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_requests, num_heads, num_splits, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, F16_DOT: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    # Highest tile ids first: in a causal prefill the last tiles of a request do the most work.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
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
    row_tok = rows // GROUP_P
    row_head = rows % GROUP_P
    tok = q_tile_start + row_tok
    row_ok = (row_tok < BLOCK_Q) & (tok < q_len) & (row_head < GROUP)
    head = kv_head * GROUP + row_head

    if CAUSAL:
        kv_end = ctx_start + tl.minimum(q_tile_start + BLOCK_Q, q_len)
        # Tiles below this one hold only keys every row of the tile may see.
        full_tiles = (ctx_start + q_tile_start + 1) // BLOCK_N
    else:  # every row sees the request's seq_len keys (a block drafter's block)
        kv_end = seq_len
        full_tiles = seq_len // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    t_lo = 0
    t_hi = num_tiles
    part = 0  # the partial-output rows of a split launch
    if SPLIT:
        t_lo, t_hi = _split_range(num_tiles, num_splits, split, MIN_SPLIT_TILES)
        part = ((q_start + tok) * num_heads + head) * num_splits + split
        if t_lo >= t_hi:
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    row_pos = ctx_start + tok
    q_pos = row_pos if CAUSAL else kv_end - 1 + 0 * tok
    lo_pos = row_pos - WINDOW + 1  # a sliding window's first key of each row
    lo_tile = 0  # tiles below hold no key any row sees
    safe_tile = 0  # tiles from here hold no key below any row's window
    if WINDOW > 0:
        first_row = ctx_start + q_tile_start
        last_row = ctx_start + tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
        lo_tile = tl.maximum(first_row - WINDOW + 1, 0) // BLOCK_N
        safe_tile = tl.cdiv(tl.maximum(last_row - WINDOW + 1, 0), BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q, qk_scale = _load_rows(q_ptr, q_start + tok, head, row_ok, offs_d, stride_qt, stride_qh, qk_scale, HEAD_DIM, F16_DOT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + req * stride_bt
    if WINDOW > 0:  # the tiles the windows of the rows start in
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, lo_pos, kv_end,
            tl.maximum(t_lo, lo_tile), tl.minimum(t_hi, safe_tile), offs_d,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE, True, UPCAST, IEEE, WINDOW,
        )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, lo_pos, kv_end,
        tl.maximum(t_lo, safe_tile), tl.minimum(t_hi, full_tiles), offs_d,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE, False, UPCAST, IEEE, WINDOW,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, lo_pos, kv_end,
        tl.maximum(tl.maximum(t_lo, full_tiles), safe_tile), t_hi, offs_d,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE, True, UPCAST, IEEE, WINDOW,
    )

    _store_rows(acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, part, q_start + tok, head, row_ok, offs_d,
                stride_ot, stride_oh, HEAD_DIM, SPLIT)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, num_requests, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_requests):  # a padding row: no request wrote partials for it
        return
    base = (tok * num_heads + head) * num_splits
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    denom = tl.sum(w, 0)
    # An empty split wrote only its -inf lse; its partial output is never read.
    mask = (s_ok & (lse > float("-inf")))[:, None] & (offs_d[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)

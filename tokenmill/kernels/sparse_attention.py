"""Sparse GQA over the paged KV cache: each query attends only the tokens QSA selected for it.

Query t at position p attends the complete compress blocks listed in blocks[t] (valid entries
first, then -1; block c is tokens c r .. c r + r - 1, r the compress ratio) and its partial
block, tokens (p + 1) // r * r .. p (layers/attention/qsa_ref.py states the contract). A program
owns one query token for one KV head, times the GROUP query heads sharing it; it walks the
listed blocks BLOCK_N tokens at a time (BLOCK_N // r blocks, gathered through the block table),
then one tile for the partial block, with paged attention's online-softmax step. Only
min(block_topk, complete blocks) entries are read, so a step costs what the budget says whatever
the context. With num_splits > 1 (decode: few programs) a query's tiles are cut into runs whose
partial outputs paged attention's merge kernel combines. FP8 K/V as in paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import FP8_DTYPE, dependent_launch, interpreting, launch_next, mm, next_pow2, sm_count
from tokenmill.kernels.attention import merge_partials, split_partials
from tokenmill.kernels.paged_attention import (
    LOG2E,
    _find_request,
    _load_rows,
    _online_softmax_step,
    _split_range,
    _store_rows,
)

MAX_SPLITS = 32
DECODE_WAVES = 4


@triton.jit
def _sparse_attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_requests, num_heads, num_splits, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_sel,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TOPK: tl.constexpr, RATIO: tl.constexpr, PAGE: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, F16_DOT: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(qsl_ptr, num_requests, tok, 1)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if tok - q_start >= q_len:  # a padding row past every request
        return
    position = tl.load(seq_lens_ptr + req) - q_len + tok - q_start
    complete = (position + 1) // RATIO
    listed = tl.minimum(complete, TOPK)
    PER_TILE: tl.constexpr = BLOCK_N // RATIO
    listed_tiles = tl.cdiv(listed, PER_TILE)
    num_tiles = listed_tiles + 1  # the partial block last (it may be empty)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    t_lo = 0
    t_hi = num_tiles
    part = 0  # the partial-output rows of a split launch
    if SPLIT:
        t_lo, t_hi = _split_range(num_tiles, num_splits, split, MIN_SPLIT_TILES)
        part = (tok * num_heads + head) * num_splits + split
        if t_lo >= t_hi:
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    token_rows = tl.full([BLOCK_M], 0, tl.int32) + tok
    q, qk_scale = _load_rows(q_ptr, token_rows, head, row_ok, offs_d, stride_qt, stride_qh, qk_scale, HEAD_DIM, F16_DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row = block_tables_ptr + req * stride_bt
    sel_row = blocks_ptr + tok * stride_sel
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(t_lo, t_hi):
        is_listed = tile < listed_tiles
        entry = tile * PER_TILE + offs_n // RATIO
        # The partial block's tile starts past the listed entries, so it reads none of them.
        block = tl.load(sel_row + entry, mask=(entry < listed) & (offs_n < PER_TILE * RATIO), other=-1)
        token = tl.where(is_listed, block * RATIO + offs_n % RATIO, complete * RATIO + offs_n)
        ok = tl.where(is_listed, block >= 0, token <= position)
        page = tl.load(bt_row + token // PAGE, mask=ok, other=0).to(tl.int64)
        slot = (page * stride_kb + (token % PAGE) * stride_kt)[:, None]
        kv_mask = ok[:, None] & d_ok
        k = tl.load(k_base + slot + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + (page * stride_vb + (token % PAGE) * stride_vt)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, IEEE) * qk_scale
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v.to(q.dtype), ok[None, :], True, UPCAST, IEEE)

    _store_rows(acc, m_i, l_i, v_scale, out_ptr, part_out_ptr, part_lse_ptr, part, token_rows, head, row_ok, offs_d,
                stride_ot, stride_oh, HEAD_DIM, SPLIT)


@dataclass(frozen=True)
class SparsePlan:
    block_n: int  # tokens per tile (block_n // ratio listed blocks)
    num_splits: int
    min_split_tiles: int
    num_warps: int
    num_stages: int

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def plan_sparse(*, num_tokens: int, num_kv_heads: int, block_topk: int, ratio: int, head_dim: int,
                device: torch.device, num_splits: int | None = None) -> SparsePlan:
    """From host-known sizes only: split a query's tiles while the grid is short of DECODE_WAVES
    programs per multiprocessor (decode), never into more runs than its most tiles."""
    on_gpu = device.type == "cuda" and not interpreting()
    block_n = (32 if head_dim > 128 else 64) if on_gpu else 16
    block_n = max(block_n, next_pow2(ratio))
    max_tiles = -(-block_topk // (block_n // ratio)) + 1
    if num_splits is None:
        wanted = -(-DECODE_WAVES * sm_count(device) // max(1, num_tokens * num_kv_heads))
        num_splits = max(1, min(wanted, max_tiles, MAX_SPLITS))
    return SparsePlan(block_n, num_splits, 1, 4 if head_dim <= 128 else 8, 2)


def sparse_paged_attention(
    q: torch.Tensor,  # [T, H, D], unit stride along D
    key_cache: torch.Tensor,  # [pages, page, Hkv, D], model dtype or float8_e4m3fn
    value_cache: torch.Tensor,
    blocks: torch.Tensor,  # [T, block_topk] int32: the listed blocks of each query, then -1
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_pages] int32
    ratio: int,
    scale: float,
    plan: SparsePlan,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each packed query over its selected tokens (the cache already holds this
    step's keys and values). Rows of `out` outside every request are left as they are."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(q) if out is None else out
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    if q.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("sparse_paged_attention needs a unit stride along head_dim")
    group = num_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    pdl = dependent_launch(q.device)
    splits = plan.num_splits
    part_out, part_lse = split_partials(out, splits)
    _sparse_attention_kernel[(num_tokens, num_kv_heads, splits)](
        out, part_out, part_lse, q, key_cache, value_cache, blocks,
        block_tables, seq_lens, query_start_loc,
        num_requests, num_heads, splits, scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), blocks.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=max(16, next_pow2(group)),
        BLOCK_N=plan.block_n, TOPK=blocks.shape[1], RATIO=ratio, PAGE=page,
        SPLIT=plan.split, MIN_SPLIT_TILES=plan.min_split_tiles,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        F16_DOT=key_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16, LAUNCH_NEXT=pdl,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    merge_partials(out, part_out, part_lse, query_start_loc, num_requests, splits, pdl)
    return out

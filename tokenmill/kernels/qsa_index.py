"""QSA's block scores: every query against the pooled index keys of its complete blocks.

score[t, c] = sum over index heads h of relu(q[t, h] . k[c]) / sqrt(D) for c < (p_t + 1) // r
(p_t the query's position, r the compress ratio), -inf for the other columns up to `width`.
A launch may cover a run of the packed query rows (a long prefill is scored a slice at a time,
so the [rows, width] scores stay small). A program owns one query and BLOCK_C blocks: it gathers
their keys from the paged indexer cache ([pages, page // r, D], block c in row (c r % page) // r
of page block_table[c r // page]) and multiplies them by all the query's index heads at once. The position comes from seq_lens and
query_start_loc, as in paged attention, so the launch needs only host-side sizes (T, width).
This is the part of a QSA step that grows with the context (one D-wide key per r tokens); the
selection (torch.topk) and the attention over the selected tokens do not.

Layout matches layers/attention/qsa_ref.py's block_scores_ref, which it is tested against.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import interpreting, mm, next_pow2
from tokenmill.kernels.paged_attention import _find_request


@triton.jit
def _block_scores_kernel(
    scores_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    num_requests, width, first_token, score_scale,
    stride_st, stride_qt, stride_qh, stride_cp, stride_cr, stride_bt,
    NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
    RATIO: tl.constexpr, PAGE: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    tok = first_token + tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    req = _find_request(qsl_ptr, num_requests, tok, 1)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    position = tl.load(seq_lens_ptr + req) - q_len + tok - q_start
    complete = tl.where(tok - q_start < q_len, (position + 1) // RATIO, 0)  # 0 for rows past every request
    c_ok = offs_c < complete
    scores = tl.full([BLOCK_C], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_C < complete:
        heads = tl.arange(0, HEADS_P)
        offs_d = tl.arange(0, DIM_P)
        d_ok = offs_d[None, :] < HEAD_DIM
        q = tl.load(q_ptr + tl.program_id(0) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=(heads[:, None] < NUM_HEADS) & d_ok, other=0.0)
        first = offs_c * RATIO
        page = tl.load(block_tables_ptr + req * stride_bt + first // PAGE, mask=c_ok, other=0).to(tl.int64)
        row = (first % PAGE) // RATIO
        k = tl.load(cache_ptr + page[:, None] * stride_cp + row[:, None] * stride_cr + offs_d[None, :],
                    mask=c_ok[:, None] & d_ok, other=0.0)
        s = mm(q, tl.trans(k.to(q.dtype)), tl.zeros([HEADS_P, BLOCK_C], tl.float32), UPCAST, IEEE)
        scores = tl.where(c_ok, tl.sum(tl.maximum(s, 0.0), 0) * score_scale, float("-inf"))
    tl.store(scores_ptr + tl.program_id(0) * stride_st + offs_c, scores, mask=offs_c < width)


def score_block_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" and not interpreting() else 16


def block_scores(
    q_index: torch.Tensor,  # [n, NH, D] of query rows first_token .. first_token + n - 1, unit stride along D
    index_cache: torch.Tensor,  # [pages, page // ratio, D]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_pages] int32
    ratio: int,
    width: int,  # columns: at least the most complete blocks of any query (host-known)
    first_token: int = 0,
) -> torch.Tensor:
    """[n, width] float32 block scores (-inf where a query has no such complete block)."""
    num_tokens, num_heads, dim = q_index.shape
    scores = torch.empty((num_tokens, width), dtype=torch.float32, device=q_index.device)
    if num_tokens == 0 or width == 0:
        return scores
    if q_index.stride(2) != 1 or index_cache.stride(2) != 1:
        raise ValueError("block_scores needs a unit stride along the index head dimension")
    block_c = score_block_size(q_index.device)
    _block_scores_kernel[(num_tokens, triton.cdiv(width, block_c))](
        scores, q_index, index_cache, block_tables, seq_lens, query_start_loc,
        seq_lens.shape[0], width, first_token, 1.0 / math.sqrt(dim),
        scores.stride(0), q_index.stride(0), q_index.stride(1), index_cache.stride(0), index_cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads, HEADS_P=max(16, next_pow2(num_heads)), HEAD_DIM=dim, DIM_P=max(16, next_pow2(dim)),
        RATIO=ratio, PAGE=index_cache.shape[1] * ratio, BLOCK_C=block_c,
        UPCAST=interpreting() and q_index.dtype == torch.bfloat16, IEEE=q_index.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return scores

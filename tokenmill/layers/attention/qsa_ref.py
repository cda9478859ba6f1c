"""QSA (Qwen4Exp's indexed sparse attention) in plain PyTorch, over the paged caches: the scores
of each query's complete key blocks, their selection, and attention over the selected tokens.
Slow (a loop over requests) and obviously correct; the Triton kernels are tested against it.

Selection contract, shared by every backend: `blocks[t]` ([T, block_topk] int32) lists the
complete compress blocks query t attends, first, then -1. Query t at position p has
nb = (p + 1) // compress_ratio complete blocks (its own included when p closes one); it keeps the
block_topk best by score (all of them when nb <= block_topk), and always attends its partial
block, tokens nb * compress_ratio .. p, which `blocks` does not list.

The indexer cache holds block c of a request (tokens c * r .. c * r + r - 1, r the compress
ratio) in row (c * r % page) // r of page block_table[c * r // page]: the page of its tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.torch_ref import gather_kv


def query_positions(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """[T] int64: the position of every packed query token."""
    positions = [p for q_len, seq_len in zip(metadata.query_lens_host, metadata.seq_lens_host)
                 for p in range(seq_len - q_len, seq_len)]
    return torch.tensor(positions, dtype=torch.long, device=device)


def compressed_rows(block_table: torch.Tensor, num_blocks: int, page: int, ratio: int) -> torch.Tensor:
    """[num_blocks]: the rows of the flat indexer cache [pages * page // ratio, D] holding blocks
    0 .. num_blocks - 1 of a request."""
    tokens = torch.arange(num_blocks, device=block_table.device) * ratio
    return block_table[tokens // page].long() * (page // ratio) + (tokens % page) // ratio


def _request_keys(index_cache: torch.Tensor, block_table: torch.Tensor, count: int, ratio: int) -> torch.Tensor:
    """[count, D] float32: a request's first `count` pooled keys."""
    page = index_cache.shape[1] * ratio
    return index_cache.view(-1, index_cache.shape[-1])[compressed_rows(block_table, count, page, ratio)].float()


def _scores(q_index: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[..., count]: sum over heads of relu(q . k) / sqrt(D) for q_index [..., NH, D], keys [count, D],
    in transformers' order of operations (so that equal scores come out equal)."""
    scores = torch.matmul(q_index.float(), keys.transpose(-1, -2)).transpose(-1, -2)
    return torch.relu(scores).sum(dim=-1) / math.sqrt(q_index.shape[-1])


def block_scores_ref(q_index: torch.Tensor, index_cache: torch.Tensor, metadata: AttentionMetadata,
                     ratio: int) -> torch.Tensor:
    """[T, max_seq_len // ratio] float32: sum over index heads of relu(q_h . k_c) / sqrt(D) for each
    query's complete blocks c, -inf past them. q_index [T, NH, D]; index_cache [pages, page // ratio, D]."""
    num_tokens = q_index.shape[0]
    width = metadata.max_seq_len // ratio
    scores = torch.full((num_tokens, width), float("-inf"), dtype=torch.float32, device=q_index.device)
    positions = query_positions(metadata, q_index.device)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        count = seq_len // ratio
        rows = slice(start, start + q_len)
        start += q_len
        if count == 0:
            continue
        s = _scores(q_index[rows], _request_keys(index_cache, metadata.block_tables[b], count, ratio))
        visible = torch.arange(count, device=s.device)[None, :] < ((positions[rows] + 1) // ratio)[:, None]
        scores[rows, :count] = torch.where(visible, s, float("-inf"))
    return scores


def select_blocks(scores: torch.Tensor, block_topk: int) -> torch.Tensor:
    """[T, block_topk] int32: the best-scoring blocks of each row, then -1 (scores are >= 0 where
    a block exists, -inf where not). Blocks of equal score are taken in torch.topk's order."""
    num_tokens, width = scores.shape
    blocks = torch.full((num_tokens, block_topk), -1, dtype=torch.int32, device=scores.device)
    keep = min(block_topk, width)
    if keep:
        values, index = scores.topk(keep, dim=1)
        blocks[:, :keep] = torch.where(values == float("-inf"), -1, index).to(torch.int32)
    return blocks


def select_blocks_ref(q_index: torch.Tensor, index_cache: torch.Tensor, metadata: AttentionMetadata, ratio: int,
                      block_topk: int) -> torch.Tensor:
    """select_blocks(block_scores_ref(...)) one query at a time, each over exactly its complete
    blocks as transformers does, so that blocks of equal score (all index heads negative: a score
    of 0) are chosen alike."""
    positions = query_positions(metadata, q_index.device).tolist()
    blocks = torch.full((q_index.shape[0], block_topk), -1, dtype=torch.int32, device=q_index.device)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        keys = _request_keys(index_cache, metadata.block_tables[b], seq_len // ratio, ratio)
        for t in range(start, start + q_len):
            complete = (positions[t] + 1) // ratio
            if complete:
                chosen = _scores(q_index[t], keys[:complete]).topk(min(block_topk, complete), dim=0).indices
                blocks[t, : chosen.numel()] = chosen.to(torch.int32)
        start += q_len
    return blocks


def selected_token_mask(blocks: torch.Tensor, positions: torch.Tensor, seq_len: int, ratio: int) -> torch.Tensor:
    """[q_len, seq_len] bool: which tokens each query attends (its listed blocks, its partial
    block; never a token after it)."""
    token_block = torch.arange(seq_len, device=blocks.device) // ratio
    listed = (token_block[None, :, None] == blocks[:, None, :].long()).any(-1)
    partial = token_block[None, :] >= ((positions + 1) // ratio)[:, None]
    return (listed | partial) & (torch.arange(seq_len, device=blocks.device)[None, :] <= positions[:, None])


def sparse_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, blocks: torch.Tensor,
                         ratio: int, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """[T, H, D]: GQA of q [T, H, D] over each query's selected tokens of the paged K/V cache."""
    out = torch.zeros_like(q)
    group = q.shape[1] // kv_cache.shape[3]
    positions = query_positions(metadata, q.device)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
        rows = slice(start, start + q_len)
        start += q_len
        keys, values = gather_kv(kv_cache, metadata.block_tables[b], seq_len)
        keys = (keys.to(q.dtype) * k_scale).repeat_interleave(group, dim=1)
        values = (values.to(q.dtype) * v_scale).repeat_interleave(group, dim=1)
        mask = selected_token_mask(blocks[rows], positions[rows], seq_len, ratio)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale,
        ).transpose(0, 1)
    return out

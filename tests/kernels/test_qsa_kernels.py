"""QSA's kernels against the PyTorch reference (layers/attention/qsa_ref.py): the block scores
over the paged indexer cache, and sparse attention over each query's selected tokens of the
paged K/V cache (prefill chunks, decode with and without splits, GQA, FP8 K/V)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu, paged_batch

from tokenmill.kernels.kv_cache import quantize_fp8_ref
from tokenmill.kernels.qsa_index import block_scores
from tokenmill.kernels.sparse_attention import plan_sparse, sparse_paged_attention
from tokenmill.layers.attention.qsa_ref import (
    block_scores_ref,
    query_positions,
    select_blocks,
    select_blocks_ref,
    sparse_attention_ref,
)

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2.5e-2}

# (query_len, seq_len) per request: prompts shorter than the budget, blocks closing exactly at a
# query, partial last blocks, decodes deep past the budget.
MIXED_TINY = [(5, 5), (1, 41), (7, 30), (1, 3), (12, 12), (1, 64)]
DECODE_TINY = [(1, 70), (1, 33), (1, 4), (1, 1)]
REAL_DECODE = [(1, n) for n in (4096, 32768, 777, 131072)]
REAL_MIXED = [(2048, 2048), (512, 6000), (1, 32768), (37, 300)]


def random_blocks(metadata, ratio: int, block_topk: int, seed: int) -> torch.Tensor:
    """A valid selection: per query min(topk, complete) distinct complete blocks in random order, then -1."""
    gen = torch.Generator().manual_seed(seed)
    positions = query_positions(metadata, torch.device("cpu"))
    blocks = torch.full((positions.shape[0], block_topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        complete = (p + 1) // ratio
        chosen = torch.randperm(complete, generator=gen)[:block_topk]
        blocks[t, : chosen.numel()] = chosen.int()
    return blocks


@pytest.mark.parametrize("requests, num_heads, head_dim, page, dtype, device", [
    on_cpu(MIXED_TINY, 8, 8, 8, torch.float32, id="tiny-fp32"),
    on_cpu(DECODE_TINY, 3, 16, 16, torch.bfloat16, id="tiny-bf16"),
    on_gpu(REAL_MIXED, 32, 128, 16, torch.bfloat16, id="real-mixed"),
])
def test_block_scores(requests, num_heads: int, head_dim: int, page: int, dtype: torch.dtype, device: str) -> None:
    ratio = 4
    torch.manual_seed(0)
    batch = paged_batch(requests, page, device)
    md = batch.metadata
    q = torch.randn(sum(q for q, _ in requests), num_heads, head_dim, device=device).to(dtype)
    cache = torch.randn(batch.num_blocks, page // ratio, head_dim, device=device).to(dtype)
    width = md.max_seq_len // ratio + 3  # wider than needed: the extra columns are -inf too
    got = block_scores(q, cache, md.query_start_loc, md.seq_lens, md.block_tables, ratio, width)
    ref = block_scores_ref(q, cache, md, ratio)
    assert got.shape[1] == ref.shape[1] + 3 and torch.isinf(got[:, ref.shape[1]:]).all()
    got = got[:, : ref.shape[1]]
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[finite], ref[finite], rtol=tol, atol=tol)
    # A slice of the rows (a long prefill is scored a slice at a time) gives those rows.
    first, rows = 3, 6
    part = block_scores(q[first : first + rows], cache, md.query_start_loc, md.seq_lens, md.block_tables, ratio, width,
                        first)
    torch.testing.assert_close(part, block_scores(q, cache, md.query_start_loc, md.seq_lens, md.block_tables, ratio,
                                                  width)[first : first + rows])
    if dtype == torch.float32:  # no ties at these scores: both selections agree
        topk = 3
        assert torch.equal(select_blocks(got, topk), select_blocks_ref(q, cache, md, ratio, topk))


@pytest.mark.parametrize("requests, heads, kv_heads, head_dim, topk, dtype, kv_dtype, splits, device", [
    on_cpu(MIXED_TINY, 4, 2, 16, 3, torch.float32, torch.float32, None, id="tiny-mixed-fp32"),
    on_cpu(DECODE_TINY, 4, 1, 16, 5, torch.float32, torch.float32, 3, id="tiny-decode-split"),
    on_cpu(MIXED_TINY, 6, 2, 16, 2, torch.bfloat16, FP8, None, id="tiny-mixed-fp8"),
    on_cpu(DECODE_TINY, 2, 2, 32, 40, torch.bfloat16, torch.bfloat16, 2, id="tiny-budget-beyond-context"),
    on_gpu(REAL_DECODE, 16, 2, 256, 512, torch.bfloat16, torch.bfloat16, None, id="real-decode-bf16"),
    on_gpu(REAL_DECODE, 16, 2, 256, 512, torch.bfloat16, FP8, None, id="real-decode-fp8"),
    on_gpu(REAL_MIXED, 16, 2, 256, 512, torch.bfloat16, FP8, None, id="real-mixed-fp8"),
])
def test_sparse_attention(requests, heads: int, kv_heads: int, head_dim: int, topk: int, dtype: torch.dtype,
                          kv_dtype: torch.dtype, splits: int | None, device: str) -> None:
    ratio, page = 4, 16
    torch.manual_seed(1)
    batch = paged_batch(requests, page, device)
    md = batch.metadata
    num_tokens = sum(q for q, _ in requests)
    q = torch.randn(num_tokens, heads, head_dim, device=device).to(dtype)
    cache = torch.randn(2, batch.num_blocks, page, kv_heads, head_dim, device=device)
    scales = (0.5, 2.0) if kv_dtype == FP8 else (1.0, 1.0)
    if kv_dtype == FP8:
        cache = torch.stack([quantize_fp8_ref(cache[i] * s, s) for i, s in enumerate(scales)])
    else:
        cache = cache.to(dtype)
    blocks = random_blocks(md, ratio, topk, seed=2).to(device)
    plan = plan_sparse(num_tokens=num_tokens, num_kv_heads=kv_heads, block_topk=topk, ratio=ratio, head_dim=head_dim,
                       device=torch.device(device), num_splits=splits)
    if splits is not None:
        assert plan.split
    scale = head_dim**-0.5
    got = sparse_paged_attention(q, cache[0], cache[1], blocks, md.query_start_loc, md.seq_lens, md.block_tables,
                                 ratio, scale, plan, *scales)
    ref_cache = torch.stack([cache[i].float() * s for i, s in enumerate(scales)])
    ref = sparse_attention_ref(q.float(), ref_cache, md, blocks, ratio, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_the_selection_changes_the_output() -> None:
    """Attending other blocks than the selected ones would be caught: two selections differ."""
    batch = paged_batch([(1, 40)], 16, "cpu")
    md = batch.metadata
    q, cache = torch.randn(1, 2, 16), torch.randn(2, batch.num_blocks, 16, 1, 16)
    first = torch.tensor([[0, 1, -1]], dtype=torch.int32)
    other = torch.tensor([[2, 7, -1]], dtype=torch.int32)
    a = sparse_attention_ref(q, cache, md, first, 4, 0.25)
    b = sparse_attention_ref(q, cache, md, other, 4, 0.25)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("splits, device", [on_cpu(None, id="one-run"), on_cpu(3, id="split")])
def test_sparse_attention_never_reads_unselected_tokens(splits: int | None, device: str) -> None:
    """Every token a query does not select is NaN in the cache (a NaN read anywhere would reach the
    output): the kernel's output is the clean cache's reference, so a step reads the budget only."""
    ratio, page, topk = 4, 8, 3
    batch = paged_batch([(1, 61), (1, 30)], page, device)
    md = batch.metadata
    torch.manual_seed(3)
    q = torch.randn(2, 4, 16)
    cache = torch.randn(2, batch.num_blocks, page, 2, 16)
    blocks = random_blocks(md, ratio, topk, seed=4)
    ref = sparse_attention_ref(q, cache, md, blocks, ratio, 0.25)
    poisoned = torch.full_like(cache, float("nan"))
    positions = query_positions(md, torch.device("cpu"))
    for b in range(2):
        keep = (set(blocks[b][blocks[b] >= 0].tolist()) | {int(positions[b]) // ratio})
        for token in range(int(md.seq_lens[b])):
            if token // ratio in keep and token <= positions[b]:
                slot = md.block_tables[b, token // page], token % page
                poisoned[:, slot[0], slot[1]] = cache[:, slot[0], slot[1]]
    plan = plan_sparse(num_tokens=2, num_kv_heads=2, block_topk=topk, ratio=ratio, head_dim=16,
                       device=torch.device(device), num_splits=splits)
    got = sparse_paged_attention(q, poisoned[0], poisoned[1], blocks, md.query_start_loc, md.seq_lens, md.block_tables,
                                 ratio, 0.25, plan)
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=2e-4)

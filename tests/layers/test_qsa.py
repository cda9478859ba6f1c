"""QSA indexed attention against transformers' Qwen4ExpTextAttention over whole sequences
(float32, CPU), run here chunk by chunk with requests packed together over the paged caches:
budgets smaller than the prompt, prompts shorter than the budget, blocks that close inside a
chunk or across chunks, partial last blocks."""

from __future__ import annotations

import pytest
import torch
from qwen4exp_cases import ChunkedRun, build_qsa, qsa_reference, run_qsa_chunked, tiny_config

from tokenmill.errors import ConfigError
from tokenmill.kv.planner import allocate_caches
from tokenmill.kv.specs import CacheLayer, IndexerKeySpec


@pytest.mark.parametrize("budget, ratio, block_size, chunks", [
    (8, 4, 8, (5, 1, 8)),
    (8, 4, 16, (1,)),
    (12, 2, 4, (3, 7, 1)),
    (3, 1, 4, (4, 2)),
    (64, 4, 8, (9, 2)),  # a budget beyond every prompt: dense causal attention
])
def test_chunked_packed_matches_transformers(budget: int, ratio: int, block_size: int, chunks: tuple[int, ...]) -> None:
    config = tiny_config(indexer_budget=budget, indexer_compress_ratio=ratio)
    theirs, ours = build_qsa(config, block_size)
    lengths = [1, 3, 4, 5, 13, 40, 61]
    gen = torch.Generator().manual_seed(ratio)
    inputs = [torch.randn(n, config.hidden_size, generator=gen) for n in lengths]
    got = run_qsa_chunked(ours, ChunkedRun(lengths, block_size, chunks), inputs)
    for r, x in enumerate(inputs):
        torch.testing.assert_close(got[r], qsa_reference(theirs, config, x), rtol=1e-4, atol=1e-5, msg=f"request {r}")


def test_selection_is_sparse_where_the_budget_binds() -> None:
    """A token far past the budget attends budget + partial tokens, not its whole context."""
    config = tiny_config(indexer_budget=8, indexer_compress_ratio=4)
    _, ours = build_qsa(config, 8)
    run = ChunkedRun([30], 8, (30,))
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, CacheLayer)}
    allocate_caches(layers, run.num_blocks + 1, run.num_slots + 1, "cpu")
    seen: list[torch.Tensor] = []
    indexer_forward = ours.indexer.forward
    ours.indexer.forward = lambda x, ctx: seen.append(indexer_forward(x, ctx)) or seen[-1]  # type: ignore[method-assign]
    with torch.no_grad():
        ours(torch.randn(30, config.hidden_size), run.context(run.steps()[0]))
    blocks = seen[0]
    assert blocks.shape == (30, 2)
    assert (blocks[29] >= 0).all() and len(set(blocks[29].tolist())) == 2  # 2 of 7 complete blocks
    assert (blocks[:3] == -1).all()  # no complete block yet
    assert blocks[3, 0] == 0 and blocks[3, 1] == -1  # position 3 closes block 0: its own block is a candidate


def test_indexer_cache_is_paged_beside_the_kv() -> None:
    config = tiny_config(indexer_head_dim=8, indexer_compress_ratio=4)
    _, ours = build_qsa(config, 16)
    spec = ours.indexer.cache_spec()
    assert isinstance(spec, IndexerKeySpec) and spec.shape(5) == (5, 4, 8)
    assert spec.bytes_per_block() * 4 == 16 * 8 * 4  # 8 / 4 float32 values per token
    with pytest.raises(ConfigError, match="multiple of indexer_compress_ratio"):
        build_qsa(config, 6)

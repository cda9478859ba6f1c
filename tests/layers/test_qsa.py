"""QSA indexed attention against transformers' Qwen4ExpTextAttention over whole sequences
(float32, CPU), run here chunk by chunk with requests packed together over the paged caches:
budgets smaller than the prompt, prompts shorter than the budget, blocks that close inside a
chunk or across chunks, partial last blocks."""

from __future__ import annotations

import pytest
import torch
from qwen4exp_cases import ChunkedRun, randomize_, tiny_config
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention, Qwen4ExpTextRotaryEmbedding

from tokenmill.errors import ConfigError
from tokenmill.kv.planner import allocate_caches
from tokenmill.kv.specs import CacheLayer, IndexerKeySpec
from tokenmill.layers.attention.qsa import PartialRotary, QSAAttention
from tokenmill.layers.attention.qsa_backends import QSABackend, qsa_backend
from tokenmill.models.llama import PACKED
from tokenmill.models.weights import load_checkpoint


def reference(theirs: Qwen4ExpTextAttention, config, x: torch.Tensor) -> torch.Tensor:
    """transformers over one whole sequence x [S, hidden], no cache."""
    seq = x.shape[0]
    positions = torch.arange(seq)[None]
    cos_sin = Qwen4ExpTextRotaryEmbedding(config)(x[None], positions)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        return theirs(x[None], cos_sin, mask, cache=None)[0][0]


def build(config, block_size: int, backend: QSABackend | None = None, seed: int = 0):
    theirs = Qwen4ExpTextAttention(config, layer_idx=3)
    randomize_(theirs, seed=seed)
    rotary = PartialRotary(config, config.head_dim, 512)
    ours = QSAAttention(config, rotary, backend, block_size=block_size)
    load_checkpoint(ours, theirs.state_dict().items(), PACKED)
    return theirs, ours


def run_chunked(ours: QSAAttention, run: ChunkedRun, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, CacheLayer)}
    allocate_caches(layers, run.num_blocks + 1, run.num_slots + 1, "cpu")
    for layer in layers.values():  # stale caches: nothing may be read before it is written
        for tensor in ([layer.kv_cache] if hasattr(layer, "kv_cache") else []):
            tensor.fill_(9.0)
    ours.indexer.index_cache.fill_(9.0)
    if ours.indexer.window is not None:
        ours.indexer.window.keys.fill_(9.0)
    got = [torch.empty_like(x) for x in inputs]
    with torch.no_grad():
        for step in run.steps():
            out = ours(torch.cat([inputs[r][a:b] for r, a, b in step]), run.context(step))
            row = 0
            for r, a, b in step:
                got[r][a:b] = out[row : row + b - a]
                row += b - a
    return got


@pytest.mark.parametrize("budget, ratio, block_size, chunks", [
    (8, 4, 8, (5, 1, 8)),
    (8, 4, 16, (1,)),
    (12, 2, 4, (3, 7, 1)),
    (3, 1, 4, (4, 2)),
    (64, 4, 8, (9, 2)),  # a budget beyond every prompt: dense causal attention
])
def test_chunked_packed_matches_transformers(budget: int, ratio: int, block_size: int, chunks: tuple[int, ...]) -> None:
    config = tiny_config(indexer_budget=budget, indexer_compress_ratio=ratio)
    theirs, ours = build(config, block_size)
    lengths = [1, 3, 4, 5, 13, 40, 61]
    gen = torch.Generator().manual_seed(ratio)
    inputs = [torch.randn(n, config.hidden_size, generator=gen) for n in lengths]
    got = run_chunked(ours, ChunkedRun(lengths, block_size, chunks), inputs)
    for r, x in enumerate(inputs):
        torch.testing.assert_close(got[r], reference(theirs, config, x), rtol=1e-4, atol=1e-5, msg=f"request {r}")


def test_selection_is_sparse_where_the_budget_binds() -> None:
    """A token far past the budget attends budget + partial tokens, not its whole context."""
    config = tiny_config(indexer_budget=8, indexer_compress_ratio=4)
    _, ours = build(config, 8)
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
    _, ours = build(config, 16)
    spec = ours.indexer.cache_spec()
    assert isinstance(spec, IndexerKeySpec) and spec.shape(5) == (5, 4, 8)
    assert spec.bytes_per_block() * 4 == 16 * 8 * 4  # 8 / 4 float32 values per token
    with pytest.raises(ConfigError, match="multiple of indexer_compress_ratio"):
        build(config, 6)


def test_triton_backend_matches_on_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    import tokenmill.kernels._common as common

    if not common.interpreting():
        pytest.skip("runs the kernels through TRITON_INTERPRET=1 (tests/kernels sets it)")
    config = tiny_config(indexer_budget=8, indexer_compress_ratio=4)
    _, ours = build(config, 8)
    _, triton_ours = build(config, 8, qsa_backend("triton"))
    lengths = [5, 23, 1]
    inputs = [torch.randn(n, config.hidden_size) for n in lengths]
    run = ChunkedRun(lengths, 8, (4, 1, 9))
    expected = run_chunked(ours, run, inputs)
    got = run_chunked(triton_ours, run, inputs)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

"""A step of requests adding different numbers of tokens, padded at the front to a captured
graph's query length: the real rows' logits and the cache equal the unpadded step's."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import Chunk, pack
from tokenmill.runner.cuda_graphs import PADDING_FREE_TOKENS, StepGraphs

TABLES = {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7, 8]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, kv_cache_bytes=1 << 22)


def forward(llm: LLM, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    model = llm.engine.runner.model
    return model.compute_logits(model(ids, StepContext(positions, metadata)))


def test_real_rows_and_cache_equal_the_unpadded_step(llm: LLM) -> None:
    runner = llm.engine.runner
    caches = [layer.kv_cache for layer in runner.model.scaled_cache_layers()]
    torch.manual_seed(0)
    prompts = {name: torch.randint(0, 200, (n,)).tolist() for name, n in (("a", 9), ("b", 6), ("c", 17))}
    with torch.inference_mode():
        forward(llm, *pack([Chunk(p, 0, TABLES[n]) for n, p in prompts.items()], runner.block_size, runner.device))
        before = [c.clone() for c in caches]
        # a verify of 1 draft, one of 3 drafts, and a plain decode row
        new = {"a": [5, 6], "b": [7, 8, 9, 10], "c": [11]}
        chunks = [Chunk(ids, len(prompts[n]), TABLES[n]) for n, ids in new.items()]
        ids, positions, metadata = pack(chunks, runner.block_size, runner.device)
        unpadded = forward(llm, ids, positions, metadata)
        after_unpadded = [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        step = runner.step_graphs(runner.model, 3, 5, "verify").pad(ids, StepContext(positions, metadata))  # never captured
        assert step.ctx.attention.query_lens_host == [5, 5, 5] and step.input_ids.shape == (15,)
        assert step.ctx.positions.tolist() == [*range(6, 11), *range(5, 10), *range(13, 18)]
        padded = forward(llm, step.input_ids, step.ctx.positions, step.ctx.attention)[step.real_rows]
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
    pool = slice(0, runner.num_blocks)
    for cache, expected, saved in zip(caches, after_unpadded, before):
        # The new tokens' KV as unpadded (matmuls of other row counts may round differently) ...
        torch.testing.assert_close(cache[:, pool], expected[:, pool], rtol=1e-5, atol=1e-5)
        # ... the prompts' KV, where the pad rows sit, untouched; the pad rows wrote the scratch block.
        flat, flat_saved = cache.flatten(1, 2), saved.flatten(1, 2)
        for name, prompt in prompts.items():
            slots = [TABLES[name][p // runner.block_size] * runner.block_size + p % runner.block_size
                     for p in range(len(prompt))]
            assert torch.equal(flat[:, slots], flat_saved[:, slots])
        assert not torch.equal(cache[:, runner.num_blocks :], expected[:, runner.num_blocks :])


def metadata_of(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata(query_start_loc=torch.zeros(0), seq_lens=torch.zeros(0), block_tables=torch.zeros(0),
                             slot_mapping=torch.zeros(0), query_lens_host=query_lens, seq_lens_host=seq_lens)


def test_which_steps_are_padded() -> None:
    graphs = StepGraphs.__new__(StepGraphs)  # only the fields fits_padded reads
    graphs.query_len, graphs.buckets, graphs.state_slots = 5, [1, 2, 4, 8, 16, 24, 32], None
    assert graphs.fits_padded(metadata_of([2, 5, 1], [40, 50, 60]))
    assert not graphs.fits_padded(metadata_of([2, 6], [40, 50]))  # a request longer than the graph's rows
    assert not graphs.fits_padded(metadata_of([2, 1], [40, 4]))  # padding would reach before position 0
    assert not graphs.fits_padded(metadata_of([1] * 33, [40] * 33))  # more requests than captured
    many = PADDING_FREE_TOKENS // 5 + 1  # past the free size, padding may at most double the rows
    assert graphs.fits_padded(metadata_of([3] * many, [40] * many))
    assert not graphs.fits_padded(metadata_of([1] * (many - 2) + [5, 5], [40] * many))


def test_a_request_that_cannot_be_padded_is_refused(llm: LLM) -> None:
    runner = llm.engine.runner
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot be padded to 2 rows"):
        runner.step_graphs(runner.model, 1, 2).pad(ids, StepContext(ids, metadata_of([3], [10])))
    with pytest.raises(ValueError, match="cannot be padded to 5 rows"):
        runner.step_graphs(runner.model, 1, 5).pad(ids, StepContext(ids, metadata_of([3], [4])))

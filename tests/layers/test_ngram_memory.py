"""PLE n-gram memory against transformers' Qwen4ExpTextPLELayer over whole sequences (float32,
CPU), run here chunk by chunk with requests packed together and their state in slots."""

from __future__ import annotations

import pytest
import torch
from qwen4exp_cases import ChunkedRun, randomize_, tiny_config
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding, Qwen4ExpTextPLELayer

from tokenmill.layers.ngram_memory import NGramEmbedding, PLELayer


@pytest.mark.parametrize("ple_index", [0, 2])
def test_hash_constants_match_transformers(ple_index: int) -> None:
    config = tiny_config(ngram_vocab_size_base=1000, ngram_size=4, heads_per_ngram=3, ple_embed_dim=18, seed=77)
    theirs = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=ple_index)
    ours = NGramEmbedding(config, ple_index)
    for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.ngram_embedding.weight.shape == theirs.ngram_embedding.weight.shape


def _sequences(config, lengths: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    eos = config.eos_token_id
    seqs = []
    for n in lengths:
        ids = torch.randint(0, config.vocab_size, (n,), generator=gen)
        ids[torch.rand(n, generator=gen) < 0.1] = eos  # documents inside a request
        seqs.append(ids)
    return seqs


@pytest.mark.parametrize("ngram_size, kernel", [(3, 4), (2, 3)])
def test_chunked_packed_matches_whole_sequences(ngram_size: int, kernel: int) -> None:
    config = tiny_config(ngram_size=ngram_size, ple_conv_kernel_size=kernel, ple_embed_dim=8 * (ngram_size - 1))
    theirs = Qwen4ExpTextPLELayer(config, layer_idx=0, ple_layer_index=1)
    randomize_(theirs, seed=3)
    ours = PLELayer(config, ple_index=1)
    ours.load_state_dict(theirs.state_dict(), strict=False)
    lengths = [1, 2, 13, 30, 9]
    seqs = _sequences(config, lengths, seed=ngram_size)
    gen = torch.Generator().manual_seed(5)
    streams = [torch.randn(n, config.hc_count, config.hidden_size, generator=gen) for n in lengths]
    with torch.no_grad():
        refs = [theirs(s.flatten(1)[None], ids[None], cache=None)[0].view_as(s) for s, ids in zip(streams, seqs)]
    run = ChunkedRun(lengths, block_size=4, chunk_sizes=(1, 5, 2, 7))
    state = ours.cache_spec().allocate(run.num_slots, "cpu")
    for tensor in state.values():  # stale slots: a fresh request must not read them
        tensor.fill_(7)
    ours.bind_cache(state)
    got = [torch.empty_like(s) for s in streams]
    with torch.no_grad():
        for step in run.steps():
            ctx = run.context(step)
            x = torch.cat([streams[r][a:b] for r, a, b in step])
            ids = torch.cat([seqs[r][a:b] for r, a, b in step])
            out = ours(x, ids, ctx)
            row = 0
            for r, a, b in step:
                got[r][a:b] = out[row : row + b - a]
                row += b - a
    for r in range(len(lengths)):
        torch.testing.assert_close(got[r], refs[r], rtol=1e-5, atol=1e-5, msg=f"request {r}")


def test_packed_requests_do_not_hash_across_their_boundary() -> None:
    """The same tokens give the same ids whatever request was packed before them."""
    config = tiny_config()
    ours = PLELayer(config, ple_index=0)
    randomize_(ours, seed=1)
    run = ChunkedRun([6, 6], block_size=4, chunk_sizes=(6,))
    ours.bind_cache(ours.cache_spec().allocate(run.num_slots, "cpu"))
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    streams = torch.randn(6, config.hc_count, config.hidden_size)
    ctx = run.context(run.steps()[0])
    with torch.no_grad():
        out = ours(torch.cat([streams, streams]), torch.cat([torch.tensor([50, 51, 52, 53, 54, 55]), ids]), ctx)
        alone = ours(streams, ids, ChunkedRun([6], block_size=4, chunk_sizes=(6,)).context([(0, 0, 6)]))
    torch.testing.assert_close(out[6:], alone)


def test_state_checkpoint_resumes_mid_chunk() -> None:
    """A step with state checkpoints stores the windows after the marked token in that slot; a
    request resumed from it (rejected drafts rolled back, a prefix hit) continues exactly."""
    config = tiny_config()
    theirs = Qwen4ExpTextPLELayer(config, layer_idx=0, ple_layer_index=0)
    randomize_(theirs, seed=4)
    ours = PLELayer(config, ple_index=0)
    ours.load_state_dict(theirs.state_dict(), strict=False)
    ids = _sequences(config, [20], seed=9)[0]
    streams = torch.randn(20, config.hc_count, config.hidden_size)
    with torch.no_grad():
        ref = theirs(streams.flatten(1)[None], ids[None], cache=None)[0].view_as(streams)
    run = ChunkedRun([20], block_size=4)
    ours.bind_cache(ours.cache_spec().allocate(4, "cpu"))
    first = run.context([(0, 0, 12)])
    first.state_slots = torch.tensor([0])
    first.state_checkpoints = torch.tensor([-1] * 7 + [2] + [-1] * 4)  # the windows after position 7 -> slot 2
    with torch.no_grad():
        ours(streams[:12], ids[:12], first)
        resumed = run.context([(0, 8, 20)])
        resumed.state_slots = torch.tensor([2])
        out = ours(streams[8:], ids[8:], resumed)
    torch.testing.assert_close(out, ref[8:], rtol=1e-5, atol=1e-5)

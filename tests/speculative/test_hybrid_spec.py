"""Speculative decoding on Gated-DeltaNet hybrids: a verify step writes the recurrent state after
every draft row into the request's spare slots, and accepting tau drafts re-points the request at
the state after row tau. Greedy output equals plain decoding for every tau (a proposer that knows
the answer and spoils one draft per step on purpose), for n-gram and draft-model proposers, under
batching, chunked prefill and preemption; a verify step staged into the static CUDA-graph buffers
writes the same checkpoints as the eager step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hybrid_models import VOCAB, SpoilingProposer, hybrid_llm, random_prompts, save_hybrid
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill import SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import Chunk, pack

GAMMA = 3
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_next")
    save_hybrid("qwen3_next", path)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts((5, 70, 23, 41), seed=7)


@pytest.fixture(scope="module")
def reference(target: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in hybrid_llm(target).generate(prompts, PARAMS)]


def test_every_acceptance_length_restores_the_state_exactly(target: Path, prompts: list[list[int]],
                                                            reference: list[list[int]]) -> None:
    """Batched, chunked and preempted (three sequences, a small cache): the answer of plain
    decoding, with tau = 0..gamma each accepted, and every state slot back at the end."""
    llm = hybrid_llm(target, max_num_batched_tokens=16, max_num_seqs=3, kv_cache_bytes=13 * 5376 + 4 * 5376 + 15 * 2048,
                     mamba_snapshot_bytes=4 * 5376, max_model_len=120,
                     speculative_config={"method": "ngram", "num_speculative_tokens": GAMMA})
    engine = llm.engine
    assert engine.kv.state.num_spares == GAMMA
    engine.proposer = SpoilingProposer({tuple(p): a for p, a in zip(prompts, reference)}, VOCAB)
    outs = llm.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = engine.stats()
    assert all(n > 0 for n in stats.spec_num_accepted_tokens_per_pos)  # tau = gamma happened
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # and rollbacks
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.state.num_free == engine.kv.state.num_slots and engine.kv.pool.num_used == 0


def test_ngram_keeps_greedy_output(target: Path, reference: list[list[int]]) -> None:
    llm = hybrid_llm(target, speculative_config={"method": "ngram", "num_speculative_tokens": GAMMA,
                                                 "prompt_lookup_min": 1})
    repeated = random_prompts((12,), seed=9)[0] * 4
    plain = hybrid_llm(target).generate([repeated], PARAMS)[0].outputs[0].token_ids
    assert llm.generate([repeated], PARAMS)[0].outputs[0].token_ids == plain
    assert llm.engine.stats().spec_num_drafts > 0


def test_draft_model_keeps_greedy_output(target: Path, prompts: list[list[int]], reference: list[list[int]],
                                         tmp_path: Path) -> None:
    torch.manual_seed(3)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512))
    draft.save_pretrained(tmp_path)
    llm = hybrid_llm(target, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                                 "num_speculative_tokens": GAMMA})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == reference
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_draft_model_with_recurrent_state_is_refused(target: Path) -> None:
    with pytest.raises(ConfigError, match="draft model has recurrent"):
        hybrid_llm(target, speculative_config={"method": "draft_model", "model": str(target),
                                               "num_speculative_tokens": GAMMA})


def test_verify_step_staged_in_graph_buffers_writes_the_eager_checkpoints(target: Path) -> None:
    """A verify step (1 + gamma rows per request) staged into the static buffers a CUDA graph
    replays (built on the CPU, never captured): padding requests take the scratch slot and no
    checkpoints, and the real rows' logits and every checkpoint slot equal the eager step's."""
    llm = hybrid_llm(target, speculative_config={"method": "ngram", "num_speculative_tokens": GAMMA})
    runner = llm.engine.runner
    model, plan, q = runner.model, runner.cache_plan, 1 + GAMMA
    graphs = runner.step_graphs(model, 4, q, "verify")
    states = runner.state_tensors
    with torch.inference_mode():
        tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        prefixes = random_prompts((9, 17, 4), seed=11)
        ids, positions, metadata = pack([Chunk(p, 0, t) for p, t in zip(prefixes, tables)], runner.block_size,
                                        runner.device)
        slots = torch.tensor([0, 4, 8])
        model(ids, dataclasses.replace(StepContext(positions, metadata), state_slots=slots))
        before = [t.clone() for t in states]
        rows = random_prompts((q, q, q), seed=12)
        ids, positions, metadata = pack([Chunk(r, len(p), t) for r, p, t in zip(rows, prefixes, tables)],
                                        runner.block_size, runner.device)
        checkpoints = torch.tensor([1, 2, 3, -1, 5, 6, 7, -1, 9, 10, 11, -1])
        ctx = dataclasses.replace(StepContext(positions, metadata), state_slots=slots, state_checkpoints=checkpoints)
        eager = model.compute_logits(model(ids, ctx))
        after = [t.clone() for t in states]
        for t, saved in zip(states, before):
            t.copy_(saved)
        bucket, context = graphs.stage(ids, ctx)
        static = graphs.static_context(bucket, context)
        assert bucket == 4 and static.state_slots.tolist() == [0, 4, 8, plan.scratch_slot]
        assert static.state_checkpoints.tolist() == checkpoints.tolist() + [-1] * q
        static.attention = dataclasses.replace(static.attention, seq_lens_host=[len(p) + q for p in prefixes] + [q])
        staged = model.compute_logits(model(graphs.input_ids[: bucket * q], static))
    torch.testing.assert_close(staged[: 3 * q], eager, rtol=1e-5, atol=1e-5)
    for t, expected in zip(states, after):
        torch.testing.assert_close(t[: plan.scratch_slot], expected[: plan.scratch_slot], rtol=1e-5, atol=1e-5)

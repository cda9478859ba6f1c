"""Kimi-Linear through the engine (float32, CPU), against transformers' greedy tokens: a batch under
chunked prefill and forced preemption (KDA state recomputed, latent blocks freed); prefix hits of
unaligned lengths resuming KDA state snapshots beside shared latent blocks; speculative decoding
with every acceptance length (KDA state rolled back to the accepted draft's checkpoint, MLA
verified through the absorbed path), with n-gram drafts and with a draft model; a request's tokens whatever batch it
runs in and whatever the step budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_models import VOCAB, SpoilingProposer, hf_greedy, hybrid_llm, random_prompts
from kimi_models import save_kimi
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.runner.model_runner import ModelRunner

GAMMA = 3
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts((5, 17, 40, 130, 29, 61), seed=2)


@pytest.fixture(scope="module", params=["kimi", "kimi-q-lora-grouped"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(checkpoint, transformers' greedy continuation of every prompt)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_kimi(request.param, path)
    return path, [hf_greedy(hf_model, p, PARAMS.max_tokens) for p in PROMPTS]


def pressed_budget(path: Path, blocks: int, seqs: int, slots_per_seq: int = 1, snapshots: int = 4) -> dict:
    """Engine settings whose cache holds `blocks` latent blocks beside the state slots of `seqs`
    requests and `snapshots` prefix snapshots (sizes from the model's own plan)."""
    runner: ModelRunner = hybrid_llm(path).engine.runner
    plan = runner.cache_plan
    state = (seqs * slots_per_seq + 1) * plan.bytes_per_state_slot
    return dict(max_num_seqs=seqs, mamba_snapshot_bytes=snapshots * plan.bytes_per_state_slot,
                kv_cache_bytes=state + snapshots * plan.bytes_per_state_slot + blocks * plan.bytes_per_block)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def test_batched_chunked_preempted_greedy_equals_transformers(model) -> None:
    """Six prompts in steps of 16 tokens, three sequences at most, 25 blocks of 8 tokens for all (the
    200 of max_model_len): prefills split across steps, requests preempted and recomputed from scratch."""
    path, expected = model
    llm = hybrid_llm(path, max_num_batched_tokens=16, max_model_len=200, **pressed_budget(path, 25, 3))
    assert llm.engine.kv.num_blocks == 25
    assert greedy(llm, PROMPTS) == expected
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0 and engine.kv.state.num_free == engine.kv.state.num_slots


def test_batch_and_budget_do_not_change_a_requests_tokens(model) -> None:
    """Each prompt alone in one prefill, all of them together under budgets of 48 and 7 tokens per
    step: the same tokens (transformers')."""
    path, expected = model
    roomy = hybrid_llm(path, max_num_batched_tokens=512, max_num_seqs=6)
    assert [greedy(roomy, [p])[0] for p in PROMPTS] == expected
    for budget in (48, 7):
        assert greedy(hybrid_llm(path, max_num_batched_tokens=budget, max_num_seqs=6), PROMPTS) == expected, budget


BASE = random_prompts((100,), seed=21)[0]
FRESH = random_prompts((40,), seed=22)[0]
# (shared prefix length, new tokens after it) -> cached tokens: the deepest snapshot (every 32
# tokens, and 96: the base prompt's last full block) within the paged hit of 8-token blocks.
FOLLOW_UPS = {(37, 10): 32, (61, 12): 32, (99, 3): 96, (100, 5): 96, (20, 30): 0, (70, 1): 64}


def test_unaligned_prefix_hits_resume_kda_snapshots(model) -> None:
    path, _ = model
    follow_ups = {key: BASE[: key[0]] + FRESH[: key[1]] for key in FOLLOW_UPS}
    settings = dict(mamba_state_interval=32, max_num_batched_tokens=32)
    cold = hybrid_llm(path, **settings, enable_prefix_caching=False)
    expected = {key: greedy(cold, [prompt])[0] for key, prompt in follow_ups.items()}
    llm = hybrid_llm(path, **settings)
    greedy(llm, [BASE])
    for key, prompt in follow_ups.items():
        out = llm.generate([prompt], PARAMS)[0]
        assert out.outputs[0].token_ids == expected[key], key
        assert out.num_cached_tokens == FOLLOW_UPS[key], key
    stats = llm.engine.stats()
    assert stats.state_snapshot_hits == sum(1 for v in FOLLOW_UPS.values() if v)
    assert stats.prefix_cache_paged_hits > stats.prefix_cache_hits == sum(FOLLOW_UPS.values())


def test_every_acceptance_length_restores_the_state_exactly(model) -> None:
    """Batched, chunked and preempted, the proposer right up to the draft it spoils (tau = 0..gamma
    accepted in turn): transformers' tokens, and every slot and block back at the end."""
    path, expected = model
    llm = hybrid_llm(path, max_num_batched_tokens=16, max_model_len=200,
                     speculative_config={"method": "ngram", "num_speculative_tokens": GAMMA},
                     **pressed_budget(path, 25, 3, slots_per_seq=1 + GAMMA))
    engine = llm.engine
    assert engine.kv.state.num_spares == GAMMA
    engine.proposer = SpoilingProposer({tuple(p): a for p, a in zip(PROMPTS, expected)}, VOCAB)
    assert greedy(llm, PROMPTS) == expected
    stats = engine.stats()
    assert all(n > 0 for n in stats.spec_num_accepted_tokens_per_pos)  # tau = gamma happened
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # and rollbacks
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.state.num_free == engine.kv.state.num_slots and engine.kv.pool.num_used == 0


def test_ngram_speculation_keeps_greedy_output(model) -> None:
    path, _ = model
    repeated = random_prompts((12,), seed=9)[0] * 4
    plain = greedy(hybrid_llm(path), [repeated])
    llm = hybrid_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": GAMMA,
                                               "prompt_lookup_min": 1})
    assert greedy(llm, [repeated]) == plain
    assert llm.engine.stats().spec_num_drafts > 0


def test_draft_model_speculation_keeps_greedy_output(model, tmp_path: Path) -> None:
    path, expected = model
    torch.manual_seed(3)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512))
    draft.save_pretrained(tmp_path)
    llm = hybrid_llm(path, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                               "num_speculative_tokens": GAMMA})
    assert greedy(llm, PROMPTS) == expected
    assert llm.engine.stats().spec_num_drafts > 0

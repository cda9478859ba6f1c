"""Qwen4Exp against transformers' Qwen4ExpForCausalLM, float32 on the CPU: prefill logits chunk by
chunk through the paged K/V and index caches and the state slots, every decode step's logits and
greedy token (prompts of 5 to 300 tokens, QSA budgets of 8 and 16 tokens); a batch under chunked
prefill and forced preemption gives transformers' greedy tokens and returns every slot and block;
prefix hits resume from state snapshots (the PLE and index-key windows with the GDN state) and
speculative decoding rolls them back, both with plain decoding's answers; a
Qwen4ExpForConditionalGeneration checkpoint serves its text model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hybrid_models import SavedModels, SpoilingProposer, hf_greedy, hybrid_llm
from parity import check_parity, prefill_logits, rel_err
from qwen4exp_models import QWEN4EXP_CONFIGS, VOCAB, random_prompts, save_qwen4exp
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.kv.specs import FullAttentionSpec, IndexerKeySpec, RecurrentStateSpec
from tokenmill.layers.step_context import StepContext
from tokenmill.models.qwen4_exp import IndexedAttention
from tokenmill.runner.batch import Chunk, pack


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> SavedModels:
    """One saved checkpoint per config, shared by the tests of this file."""
    return SavedModels(tmp_path_factory, save_qwen4exp)


def qwen4exp_llm(path: Path, **overrides: object) -> LLM:
    return hybrid_llm(path, **{"max_num_batched_tokens": 64, "max_model_len": 512, **overrides})


@pytest.mark.parametrize("name", list(QWEN4EXP_CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(name: str, saved) -> None:
    path, hf_model = saved[name]
    llm = qwen4exp_llm(path)
    model = llm.engine.runner.model
    config = hf_model.config
    kinds = ["linear_attention" if hasattr(layer, "linear_attn") else "indexed_attention" for layer in model.layers]
    assert kinds == config.layer_types
    assert [i + 1 for i, layer in enumerate(model.layers) if layer.ple is not None] == config.ple_layer_ids
    specs = model.cache_specs()
    assert {type(s) for s in specs.values()} == {FullAttentionSpec, IndexerKeySpec, RecurrentStateSpec}
    lengths = (5, 300) if name == "qwen4exp" else (70,)
    assert max(lengths) > 4 * config.indexer_budget  # the selection binds (5 tokens decode past it)
    for prompt in random_prompts(lengths):
        check_parity(llm, hf_model, prompt, steps=24 if name == "qwen4exp" else 12, tol=1e-4)


def test_batched_chunked_preempted_greedy_equals_transformers(saved) -> None:
    """Six prompts at once in steps of 16 tokens, three sequences at most, a KV cache too small for
    all of them: prefills split across steps, requests preempted and recomputed from scratch."""
    path, hf_model = saved["qwen4exp"]
    plan = qwen4exp_llm(path).engine.runner.cache_plan
    budget = 4 * plan.bytes_per_state_slot + 27 * plan.bytes_per_block
    llm = qwen4exp_llm(path, max_num_batched_tokens=16, max_num_seqs=3, kv_cache_bytes=budget, max_model_len=200,
                       mamba_snapshot_bytes=0)
    prompts = random_prompts((5, 17, 40, 130, 29, 61), seed=2)
    # Answers long enough that running requests outgrow the blocks whole-prompt admission left them.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=56, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 56)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0
    assert engine.kv.state.num_free == engine.kv.state.num_slots


def test_batch_invariance(saved) -> None:
    """A prompt's greedy tokens are the same alone, beside others, and in tiny chunks."""
    path, _ = saved["qwen4exp"]
    prompts = random_prompts((70, 9, 33), seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = qwen4exp_llm(path).generate(prompts[:1], params)[0].outputs[0].token_ids
    together = qwen4exp_llm(path, max_num_batched_tokens=24).generate(prompts, params)[0].outputs[0].token_ids
    assert alone == together


def test_conditional_generation_checkpoint_serves_its_text_model(saved, tmp_path: Path) -> None:
    """As published: config.json nests text_config under Qwen4ExpForConditionalGeneration, the text
    weights live under model.language_model.*, beside a vision tower and an MTP head (not loaded);
    the PLE table comes whole instead of in shards."""
    path, hf_model = saved["qwen4exp"]
    text_config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
        "text_config": text_config, "vision_config": {"depth": 1}}))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_model.state_dict().items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc_hidden.weight"] = torch.zeros(4, 4)
    assert any(k.endswith("ngram_embedding.weight") for k in tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    multimodal, text_only = qwen4exp_llm(tmp_path), qwen4exp_llm(path)
    assert type(multimodal.engine.runner.model).__name__ == "Qwen4ExpForConditionalGeneration"
    ours = dict(multimodal.engine.runner.model.state_dict())
    for name, tensor in text_only.engine.runner.model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    attention = multimodal.engine.runner.model.layers[3].self_attn
    assert isinstance(attention, IndexedAttention) and attention.indexer.block_topk == 2


def test_wrong_hash_constants_are_refused(saved, tmp_path: Path) -> None:
    path, hf_model = saved["qwen4exp"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = dict(hf_model.state_dict())
    tensors["model.layers.0.ple.ple_embedding.layer_multipliers"] = tensors[
        "model.layers.0.ple.ple_embedding.layer_multipliers"] + 2
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match="PLE hash constants"):
        qwen4exp_llm(tmp_path)


def test_prefix_hits_resume_state_snapshots(saved) -> None:
    """Follow-ups sharing 37 / 70 / 100 tokens of a 100-token prompt resume from the snapshots at
    32 / 64 / 96 tokens (every 32, and the prompt's last full block) and answer as without a
    prefix cache."""
    path, _ = saved["qwen4exp"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base, fresh = random_prompts((100, 20), seed=21)
    follow_ups = [(base[:37] + fresh[:9], 32), (base[:70] + fresh[:1], 64), (base + fresh[:4], 96)]
    settings = dict(mamba_state_interval=32, max_num_batched_tokens=32)
    uncached = qwen4exp_llm(path, enable_prefix_caching=False, **settings)
    cached = qwen4exp_llm(path, **settings)
    cached.generate([base], params)
    for prompt, expected in follow_ups:
        out = cached.generate([prompt], params)[0]
        assert out.num_cached_tokens == expected
        assert out.outputs[0].token_ids == uncached.generate([prompt], params)[0].outputs[0].token_ids


def test_speculative_rollback_keeps_greedy_output(saved) -> None:
    """Drafts with one wrong token at every place in turn (tau = 0 .. gamma accepted), batched and
    chunked: the windows and GDN state roll back to the accepted row; plain decoding's answers."""
    path, _ = saved["qwen4exp"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts((5, 70, 23), seed=7)
    reference = [o.outputs[0].token_ids for o in qwen4exp_llm(path).generate(prompts, params)]
    llm = qwen4exp_llm(path, max_num_batched_tokens=16, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.proposer = SpoilingProposer({tuple(p): a for p, a in zip(prompts, reference)}, VOCAB)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    stats = llm.engine.stats()
    assert all(n > 0 for n in stats.spec_num_accepted_tokens_per_pos)
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_fp8_kv_cache_is_calibrated_and_close(saved) -> None:
    """--kv-cache-dtype fp8: the calibration forward runs through the recurrent layers (a state
    slot of its own), every QSA layer gets scales, the index keys stay in the model dtype, and the
    logits stay near the float32 cache's."""
    path, _ = saved["qwen4exp"]
    prompt = random_prompts((60,), seed=5)[0]
    fp8 = qwen4exp_llm(path, kv_cache_dtype="fp8")
    attention = fp8.engine.runner.model.layers[3].self_attn
    assert attention.kv_cache.dtype == torch.float8_e4m3fn and attention.indexer.index_cache.dtype == torch.float32
    assert all(0 < s < 1 for s in attention.kv_scales)
    assert rel_err(prefill_logits(fp8, prompt), prefill_logits(qwen4exp_llm(path), prompt)) < 0.05


def test_decode_step_staged_in_graph_buffers_matches_eager(saved) -> None:
    """A decode step of three requests staged into the static buffers a CUDA graph replays (built on
    the CPU, never captured; padded to a bucket of four): the padding request runs on the scratch
    slot and block, and the real rows' logits and every state slot equal the eager step's."""
    path, _ = saved["qwen4exp"]
    runner = qwen4exp_llm(path).engine.runner
    model, plan = runner.model, runner.cache_plan
    graphs = runner.step_graphs(model, 4)
    states = runner.state_tensors
    with torch.inference_mode():
        tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        prefixes = random_prompts((9, 17, 26), seed=11)
        slots = torch.tensor([0, 2, 1])
        ids, positions, metadata = pack([Chunk(p, 0, t) for p, t in zip(prefixes, tables)], runner.block_size, runner.device)
        model(ids, StepContext(positions, metadata, slots))
        before = [t.clone() for t in states]
        ids, positions, metadata = pack([Chunk([5], len(p), t) for p, t in zip(prefixes, tables)], runner.block_size,
                                        runner.device)
        ctx = StepContext(positions, metadata, slots)
        eager = model.compute_logits(model(ids, ctx))
        after = [t.clone() for t in states]
        for t, saved_state in zip(states, before):
            t.copy_(saved_state)
        bucket, context = graphs.stage(ids, ctx)
        static = graphs.static_context(bucket, context)
        assert bucket == 4 and static.state_slots.tolist() == [0, 2, 1, plan.scratch_slot]
        static.attention = dataclasses.replace(static.attention, seq_lens_host=[len(p) + 1 for p in prefixes] + [1])
        staged = model.compute_logits(model(graphs.input_ids[:bucket], static))
    torch.testing.assert_close(staged[:3], eager, rtol=1e-5, atol=1e-5)
    for t, expected in zip(states, after):
        torch.testing.assert_close(t[: plan.scratch_slot], expected[: plan.scratch_slot], rtol=1e-5, atol=1e-5)

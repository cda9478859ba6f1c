"""Qwen3-Next and Qwen3.5 (dense, MoE) against transformers' own classes, float32 on the CPU:
prefill logits chunk by chunk through the state slots and the paged cache, every decode step's
logits and greedy token (prompts of 5 and 300 tokens, 24 new tokens); a batch of prompts under
chunked prefill and forced preemption gives transformers' greedy tokens and returns every state
slot; a multimodal Qwen3.5 checkpoint (nested text_config, `model.language_model.*`, stacked
experts, vision tower and MTP head beside) serves its text model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_models import HYBRID_CONFIGS, SavedModels, hf_greedy, hybrid_llm, random_prompts, save_hybrid
from parity import assert_same_or_near_ties, check_parity, tolerance
from safetensors.torch import load_file, save_file

from tokenmill import SamplingParams
from tokenmill.kv.specs import FullAttentionSpec, RecurrentStateSpec
from tokenmill.layers.linear_attention import GatedDeltaNet
from tokenmill.layers.moe import SparseMoeBlock


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> SavedModels:
    """One saved checkpoint per config, shared by the tests of this file."""
    return SavedModels(tmp_path_factory, save_hybrid)


@pytest.mark.parametrize("name", list(HYBRID_CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(name: str, saved) -> None:
    path, hf_model = saved[name]
    llm = hybrid_llm(path)
    model = llm.engine.runner.model
    kinds = ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention" for layer in model.layers]
    assert kinds == hf_model.config.layer_types
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    assert sparse == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_model.model.layers]
    specs = model.cache_specs()
    assert {type(s) for s in specs.values()} == {FullAttentionSpec, RecurrentStateSpec}
    for prompt in random_prompts((5, 300)):
        check_parity(llm, hf_model, prompt, steps=24, tol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_batched_chunked_preempted_greedy_equals_transformers(name: str, saved) -> None:
    """Six prompts at once in steps of 16 tokens, three sequences at most, a KV cache too small for
    all of them: prefills split across steps, requests preempted and recomputed from scratch."""
    path, hf_model = saved[name]
    llm = hybrid_llm(path, max_num_batched_tokens=16, max_num_seqs=3, kv_cache_bytes=27 * 2048 + 8 * 5376,
                     mamba_snapshot_bytes=4 * 5376, max_model_len=200)
    prompts = random_prompts((5, 17, 40, 130, 29, 61), seed=2)
    # Answers long enough that running requests outgrow the blocks whole-prompt admission left them.
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=56, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 56)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0
    assert engine.kv.state.num_free == engine.kv.state.num_slots


def test_layer_uses_value_heads_grouped_per_key_head(saved) -> None:
    """The config with three value heads per key head: a Qwen3-Next layer's packed projections are
    ungrouped per key head (the parity above fails otherwise); the state is per value head."""
    path, _ = saved["qwen3_next-dense-interval2-half-rotary"]
    layer = hybrid_llm(path).engine.runner.model.layers[0].linear_attn
    assert isinstance(layer, GatedDeltaNet) and layer.grouped_projections
    assert (layer.num_k_heads, layer.num_v_heads) == (2, 6)
    delta = {t.name: t for t in layer.cache_spec().tensors}["ssm"]
    assert delta.shape == (6, 8, 8) and delta.dtype == torch.float32


def test_multimodal_checkpoint_serves_its_text_model(saved, tmp_path: Path) -> None:
    """Qwen3.5-MoE as published: config.json nests text_config under Qwen3_5MoeForConditionalGeneration,
    text weights live under model.language_model.*, experts are stacked; the vision tower and the
    MTP head are not loaded. It serves the same logits as the text-only checkpoint."""
    path, hf_model = saved["qwen3_5_moe"]
    text_config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {**text_config, "mamba_ssm_dtype": "bfloat16"}, "vision_config": {"depth": 1}}))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_model.state_dict().items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in load_file(tmp_path / "model.safetensors")

    multimodal, text_only = hybrid_llm(tmp_path), hybrid_llm(path)
    assert type(multimodal.engine.runner.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    ours = dict(multimodal.engine.runner.model.state_dict())
    for name, tensor in text_only.engine.runner.model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    # The checkpoint's mamba_ssm_dtype is the default recurrent-state dtype.
    delta = [layer.linear_attn.delta_state for layer in multimodal.engine.runner.model.layers if hasattr(layer, "linear_attn")]
    assert {d.dtype for d in delta} == {torch.bfloat16}
    overridden = hybrid_llm(tmp_path, mamba_ssm_cache_dtype="float32").engine.runner.model.layers[0].linear_attn
    assert overridden.delta_state.dtype == torch.float32


@pytest.mark.gpu
def test_bf16_on_cuda_matches_transformers(saved) -> None:
    """The dense Qwen3.5 in bf16 through the Triton GDN kernels and CUDA graphs, against
    transformers' float32 model with twice transformers' own bf16 error as the tolerance (MoE
    configs stay on the CPU: bf16 routers flip at near-ties). The recurrent state is float32, as
    transformers keeps it whatever the model's dtype (the checkpoint's bf16 hint would add its own
    rounding, which transformers' bf16 run does not have)."""
    path, hf_model = saved["qwen3_5"]
    llm = hybrid_llm(path, device="cuda", dtype="bfloat16", mamba_ssm_cache_dtype="float32")
    assert llm.engine.runner.model.layers[0].linear_attn.use_triton
    for prompt in random_prompts((5, 300)):
        check_parity(llm, hf_model, prompt, steps=24, tol=tolerance(hf_model, prompt, "bfloat16"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_cuda_graphs_and_speculation_give_the_eager_tokens(name: str, saved) -> None:
    """Decode replayed from CUDA graphs (state slots, scratch-slot padding, checkpoint buffers) and
    n-gram speculation through the verify graphs give the eager engine's greedy tokens."""
    path, _ = saved[name]
    prompts = random_prompts((5, 17, 40, 300), seed=4) + [random_prompts((12,), seed=5)[0] * 5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    # float32 (IEEE products in the kernels): graphs and speculation give exactly the eager tokens.
    strict = hybrid_llm(path, device="cuda", dtype="float32", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in strict.generate(prompts, params)]
    for overrides in ({}, ngram):
        assert [o.outputs[0].token_ids for o in hybrid_llm(path, device="cuda", dtype="float32", **overrides)
                .generate(prompts, params)] == want, overrides
    # bf16: equal, or apart only from a near-tie of the eager logits on.
    eager = hybrid_llm(path, device="cuda", dtype="bfloat16", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    for overrides in ({}, ngram):
        graphs = hybrid_llm(path, device="cuda", dtype="bfloat16", **overrides)
        assert graphs.engine.runner.graphs
        assert_same_or_near_ties(eager, prompts, expected, [o.outputs[0].token_ids for o in graphs.generate(prompts, params)])

"""Kimi-Linear against transformers' KimiLinearForCausalLM, float32 on the CPU: prefill logits
chunk by chunk through the KDA state slots and the paged latent cache, every decode step's logits
and greedy token (prompts of 5 and 300 tokens, 24 new tokens) for every config switch; the
transformers layout of the weights loads to the same parameters as the original checkpoint's;
1-indexed layer lists; a config.json read without transformers' KimiLinearConfig (its checkpoint
field names) builds the same model; what the layer layout cannot be refused at start-up. On CUDA:
bf16 through the Triton KDA and MLA kernels, CUDA graphs and speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_models import SavedModels, hybrid_llm, random_prompts
from kimi_models import KIMI_CONFIGS, kimi_config, save_kimi
from parity import assert_same_or_near_ties, check_parity, tolerance
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from tokenmill import SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.kv.specs import LatentAttentionSpec, RecurrentStateSpec
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.linear_attention import KimiDeltaAttention
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.models.kimi_linear import DENSE, FULL, LINEAR, SPARSE, kimi_layout


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> SavedModels:
    return SavedModels(tmp_path_factory, save_kimi)


@pytest.mark.parametrize("name", KIMI_CONFIGS)
def test_logits_and_greedy_tokens_match_transformers(name: str, saved) -> None:
    path, hf_model = saved[name]
    llm = hybrid_llm(path)
    model = llm.engine.runner.model
    kinds = [LINEAR if isinstance(getattr(layer, "linear_attn", None), KimiDeltaAttention) else FULL
             for layer in model.layers]
    assert kinds == hf_model.config.layer_types
    assert all(isinstance(layer.self_attn, MLAAttention) and layer.self_attn.rotary is None
               for layer, kind in zip(model.layers, kinds) if kind == FULL)
    sparse = [SPARSE if isinstance(layer.mlp, SparseMoeBlock) else DENSE for layer in model.layers]
    assert sparse == hf_model.config.mlp_layer_types
    assert {type(s) for s in model.cache_specs().values()} == {LatentAttentionSpec, RecurrentStateSpec}
    for prompt in random_prompts((5, 300)):
        check_parity(llm, hf_model, prompt, steps=24, tol=1e-4)


def test_original_and_transformers_layouts_load_the_same_parameters(saved, tmp_path: Path) -> None:
    """save_pretrained writes the original checkpoint's names; transformers' in-memory layout (one
    conv1d over q | k | v, the forget gate's own module, stacked experts under mlp.) loads the same."""
    path, hf_model = saved["kimi-q-lora-grouped"]
    original = load_file(path / "model.safetensors")
    assert "model.layers.0.self_attn.q_conv1d.weight" in original and "model.layers.0.self_attn.A_log" in original
    assert "model.layers.3.block_sparse_moe.experts.0.w1.weight" in original
    converted = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.self_attn.forget_gate.f_a_proj.weight" in converted
    assert "model.layers.3.mlp.experts.gate_up_proj" in converted
    save_file(converted, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = dict(hybrid_llm(tmp_path).engine.runner.model.state_dict())
    for name, tensor in hybrid_llm(path).engine.runner.model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


def test_a_checkpoint_tensor_without_a_place_is_refused(saved, tmp_path: Path) -> None:
    path, _ = saved["kimi"]
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.stray.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(Exception, match="stray"):
        hybrid_llm(tmp_path)


def test_config_read_without_transformers_kimi_class_builds_the_same_model(saved, monkeypatch) -> None:
    """Where transformers has no kimi_linear (the config then comes from config.json's own field
    names: num_experts, num_shared_experts, moe_renormalize, model_max_length, linear_attn_config's
    1-indexed lists), the engine builds the same model and gives the same tokens."""
    import transformers.models.auto.configuration_auto as auto

    path, _ = saved["kimi"]
    prompt = random_prompts((40,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = hybrid_llm(path).generate([prompt], params)[0].outputs[0].token_ids
    monkeypatch.setattr(auto, "CONFIG_MAPPING", {})
    raw = json.loads((path / "config.json").read_text())
    assert {"num_experts", "num_shared_experts", "moe_renormalize", "model_max_length"} <= set(raw)
    llm = hybrid_llm(path)
    config = llm.engine.hf_config
    assert type(config) is PretrainedConfig and config.n_shared_experts == 1 and config.max_position_embeddings == 1024
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected


def layout_config(**fields: object) -> PretrainedConfig:
    base = dict(num_hidden_layers=4, hidden_act="silu", linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                num_experts=8, first_k_dense_replace=1)
    config = PretrainedConfig(**base)
    for key, value in fields.items():  # after construction: transformers validates layer_types itself
        setattr(config, key, value)
    return config


def test_layout_from_one_indexed_lists_and_first_k_dense_replace() -> None:
    layout = kimi_layout(layout_config(linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3]}))
    assert layout.mixers == (LINEAR, LINEAR, FULL, LINEAR)
    assert layout.mlps == (DENSE, SPARSE, SPARSE, SPARSE)
    assert kimi_config("kimi").layer_types == [LINEAR, LINEAR, LINEAR, FULL]  # transformers reads them alike
    every_other = kimi_layout(layout_config(layer_types=[FULL] * 4, first_k_dense_replace=0, moe_layer_freq=2))
    assert every_other.mlps == (SPARSE, DENSE, SPARSE, DENSE)
    assert kimi_layout(layout_config(layer_types=[FULL] * 4, num_experts=None)).mlps == (DENSE,) * 4


@pytest.mark.parametrize(("fields", "message"), [
    ({"linear_attn_config": {"kda_layers": [0, 1, 2], "full_attn_layers": [3]}}, "1-indexed"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3]}}, r"layers \[4\]"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 3, 4], "full_attn_layers": [4]}}, "another list"),
    ({}, "no layer layout"),
    ({"layer_types": [LINEAR, "sliding_attention", LINEAR, FULL]}, "sliding_attention"),
    ({"layer_types": [LINEAR] * 3}, "names 3 layers"),
    ({"layer_types": [FULL] * 4, "mlp_layer_types": ["dense", "moe", "dense", "dense"]}, "'moe'"),
    ({"layer_types": [FULL] * 4, "mla_use_nope": False}, "mla_use_nope"),
    ({"layer_types": [LINEAR] * 4, "hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": [FULL] * 4, "use_grouped_topk": False, "num_expert_group": 4}, "use_grouped_topk"),
    ({"layer_types": [LINEAR] * 4, "linear_num_heads": None}, "num_heads"),
])
def test_layouts_it_cannot_run_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        kimi_layout(layout_config(**fields))


@pytest.mark.gpu
def test_bf16_on_cuda_matches_transformers(tmp_path: Path) -> None:
    """A dense Kimi-Linear in bf16 through the Triton KDA (per-channel gate) and MLA kernels and
    CUDA graphs, against transformers' float32 model, the tolerance twice transformers' own bf16
    error (MoE configs stay on the CPU: bf16 routers flip at near-ties)."""
    hf_model = save_kimi("kimi-q-lora-grouped", tmp_path, mlp_layer_types=[DENSE] * 4)
    llm = hybrid_llm(tmp_path, device="cuda", dtype="bfloat16")
    assert llm.engine.runner.model.layers[0].linear_attn.use_triton
    for prompt in random_prompts((5, 300)):
        check_parity(llm, hf_model, prompt, steps=24, tol=tolerance(hf_model, prompt, "bfloat16"))


@pytest.mark.gpu
def test_cuda_graphs_and_speculation_give_the_eager_tokens(saved) -> None:
    """Decode from CUDA graphs (state slots, scratch-slot padding, latent blocks) and n-gram
    speculation through the verify graphs (KDA checkpoints, absorbed MLA verification) give the
    eager engine's greedy tokens."""
    path, _ = saved["kimi"]
    prompts = random_prompts((5, 17, 40, 300), seed=4) + [random_prompts((12,), seed=5)[0] * 5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = hybrid_llm(path, device="cuda", dtype="bfloat16", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    for overrides in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        graphs = hybrid_llm(path, device="cuda", dtype="bfloat16", **overrides)
        assert graphs.engine.runner.graphs
        assert_same_or_near_ties(eager, prompts, expected, [o.outputs[0].token_ids for o in graphs.generate(prompts, params)])


def test_fp8_latent_cache_is_calibrated_through_the_hybrid_forward(tmp_path: Path) -> None:
    """--kv-cache-dtype fp8: the MLA layers' latent scales come from a calibration forward that
    runs the KDA layers on their state slots too; logits stay within FP8's error of transformers'
    (dense MLPs: a tiny random router's top-k flips under any perturbation)."""
    hf_model = save_kimi("kimi-q-lora-grouped", tmp_path, mlp_layer_types=[DENSE] * 4)
    llm = hybrid_llm(tmp_path, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.scaled_cache_layers()
    assert len(layers) == 2 and all(isinstance(layer, MLAAttention) for layer in layers)
    assert all(layer.kv_cache.dtype == torch.float8_e4m3fn and layer.kv_scales != (1.0,) for layer in layers)
    check_parity(llm, hf_model, random_prompts((60,), seed=6)[0], steps=8, tol=5e-2)

"""A tiny Raon-style config (RDA/KDA layers + NoPE MLA + 4 hyper-connection streams + a dense first
layer then MoE) builds from Kimi-Linear's parts and the hyper-connection block, and runs end to
end on the CPU: its greedy tokens under chunked prefill, batching, preemption, prefix hits and
n-gram speculation equal its own whole-sequence forward. What the config may say is a closed
set: an unknown field (or one with a value the parts cannot run) is refused at start-up by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_models import hybrid_llm, random_prompts
from kimi_models import save_kimi
from parity import assert_same_or_near_ties
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.kv.specs import LatentAttentionSpec, RecurrentStateSpec
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.hyper_connections import HyperConnection
from tokenmill.layers.linear_attention import KimiDeltaAttention
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.models.raon import RaonForCausalLM, raon_config

HIDDEN, STREAMS, LOWRANK = 48, 4, 6
RAON = {
    "architectures": ["RaonForCausalLM"], "model_type": "raon", "vocab_size": 192, "hidden_size": HIDDEN,
    "intermediate_size": 40, "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "model_max_length": 1024, "bos_token_id": None, "eos_token_id": None,
    "linear_attn_config": {"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 4, "rda_layers": [1, 2, 3],
                           "mla_layers": [4]},
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
    "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 24, "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.5,
    "num_expert_group": 1, "topk_group": 1, "hc_count": STREAMS, "hc_lowrank": LOWRANK,
}
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hyper_connection_tensors(prefix: str, gen: torch.Generator, inject: bool = True) -> dict[str, torch.Tensor]:
    wide = STREAMS * HIDDEN
    shapes = {"hc_norm.weight": (wide,), "input_mix_weight_down.weight": (LOWRANK, wide),
              "input_mix_weight_up.weight": (wide, LOWRANK)}
    if inject:
        shapes["block_inject_weight.weight"] = (STREAMS, wide)
    return {f"{prefix}.{name}": torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def raon_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kimi-Linear's tensors (the original checkpoint's names, from transformers' save_pretrained)
    without the per-layer norms, plus random hyper-connections, under a Raon-style config."""
    kimi = tmp_path_factory.mktemp("kimi-parts")
    save_kimi("kimi", kimi)
    tensors = {k: v for k, v in load_file(kimi / "model.safetensors").items() if "layernorm" not in k or "kv_a" in k}
    gen = torch.Generator().manual_seed(5)
    for i in range(RAON["num_hidden_layers"]):
        for name in ("attn_hyper_connection", "mlp_hyper_connection"):
            tensors |= hyper_connection_tensors(f"model.layers.{i}.{name}", gen)
    tensors |= hyper_connection_tensors("model.hyper_connection_mixer", gen, inject=False)
    path = tmp_path_factory.mktemp("raon")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(RAON))
    return path


def test_raon_config_is_kimi_parts_wrapped_in_hyper_connections(raon_dir: Path) -> None:
    model = hybrid_llm(raon_dir).engine.runner.model
    assert type(model) is RaonForCausalLM and model.hc_count == STREAMS
    assert [type(getattr(layer, "linear_attn", None) or layer.self_attn) for layer in model.layers] == [
        KimiDeltaAttention] * 3 + [MLAAttention]
    assert model.layers[3].self_attn.rotary is None  # NoPE
    assert [type(layer.mlp) for layer in model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    assert model.layers[1].mlp.routing.scoring == "sigmoid" and model.layers[1].mlp.shared_expert is not None
    for layer in model.layers:
        assert isinstance(layer.attn_hyper_connection, HyperConnection)
        assert not hasattr(layer, "input_layernorm")
    assert model.hyper_connection_mixer.block_inject_weight is None
    assert {type(s) for s in model.cache_specs().values()} == {LatentAttentionSpec, RecurrentStateSpec}


def whole_sequence_greedy(llm: LLM, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens, each from one forward over the whole sequence so far (no cache carried)."""
    tokens = list(prompt)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(steps):
        tokens += llm.generate([tokens], one)[0].outputs[0].token_ids
    return tokens[len(prompt):]


def test_greedy_under_chunking_batching_preemption_and_speculation_equals_the_whole_sequence_forward(
        raon_dir: Path) -> None:
    prompts = random_prompts((5, 17, 40, 130, 29, 61), seed=2)
    oracle = hybrid_llm(raon_dir, max_num_batched_tokens=512, enable_prefix_caching=False)
    expected = [whole_sequence_greedy(oracle, p, PARAMS.max_tokens) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1
    plan = hybrid_llm(raon_dir).engine.runner.cache_plan
    pressed = hybrid_llm(raon_dir, max_num_batched_tokens=16, max_num_seqs=3, max_model_len=176,
                         kv_cache_bytes=8 * plan.bytes_per_state_slot + 22 * plan.bytes_per_block,
                         mamba_snapshot_bytes=4 * plan.bytes_per_state_slot)
    assert [o.outputs[0].token_ids for o in pressed.generate(prompts, PARAMS)] == expected
    assert pressed.engine.scheduler.num_preemptions > 0
    follow_up = prompts[3][:70] + prompts[0]  # a prefix hit of 70 tokens: snapshot at 64
    cached = hybrid_llm(raon_dir, mamba_state_interval=32, max_num_batched_tokens=32)
    cached.generate([prompts[3]], PARAMS)
    out = cached.generate([follow_up], PARAMS)[0]
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == whole_sequence_greedy(oracle, follow_up, PARAMS.max_tokens)
    spec = hybrid_llm(raon_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1})
    repeated = random_prompts((12,), seed=9)[0] * 4
    assert spec.generate([repeated], PARAMS)[0].outputs[0].token_ids == whole_sequence_greedy(
        oracle, repeated, PARAMS.max_tokens)
    assert spec.engine.stats().spec_num_drafts > 0


def test_an_unknown_field_is_refused_at_start_up_by_name(raon_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**RAON, "hc_dynamic_mixing": True}))
    (tmp_path / "model.safetensors").symlink_to(raon_dir / "model.safetensors")
    with pytest.raises(ConfigError, match="hc_dynamic_mixing"):
        hybrid_llm(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"linear_attn_config": {**RAON["linear_attn_config"], "gate_lower_bound": -5}}, "linear_attn_config.gate_lower_bound"),
    ({"hc_count": 0}, "hc_count"),
    ({"hc_lowrank": None}, "hc_lowrank"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"layer_types": ["rda", "rda", "swa", "mla"]}, "layer_types"),
    ({"linear_attn_config": {**RAON["linear_attn_config"], "rda_layers": [0, 1, 2]}}, "1-indexed"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_values_the_parts_cannot_run_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        raon_config({**RAON, **change})


def test_a_router_other_than_kimis_is_refused_at_build(raon_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**RAON, "moe_router_activation_func": "softmax"}))
    (tmp_path / "model.safetensors").symlink_to(raon_dir / "model.safetensors")
    with pytest.raises(ConfigError, match="softmax"):
        hybrid_llm(tmp_path)


def test_a_checkpoint_without_hyper_connections_is_refused(raon_dir: Path, tmp_path: Path) -> None:
    tensors = {k: v for k, v in load_file(raon_dir / "model.safetensors").items() if "hyper_connection_mixer" not in k}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(RAON))
    with pytest.raises(ModelLoadError, match="lacks"):
        hybrid_llm(tmp_path)


@pytest.mark.gpu
def test_cuda_graphs_and_speculation_give_the_eager_tokens_on_cuda(raon_dir: Path) -> None:
    """bf16 on CUDA (Triton KDA and MLA kernels): decode replayed from CUDA graphs and n-gram
    speculation through the verify graphs give the eager engine's greedy tokens."""
    prompts = random_prompts((5, 40, 300), seed=4) + [random_prompts((12,), seed=5)[0] * 5]
    eager = hybrid_llm(raon_dir, device="cuda", dtype="bfloat16", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, PARAMS)]
    for overrides in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}):
        graphs = hybrid_llm(raon_dir, device="cuda", dtype="bfloat16", **overrides)
        assert graphs.engine.runner.graphs
        assert_same_or_near_ties(eager, prompts, expected, [o.outputs[0].token_ids for o in graphs.generate(prompts, PARAMS)])

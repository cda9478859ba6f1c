"""SparseMoeBlock against transformers' own MoE blocks (float32, CPU, the reference path), with
the weights copied in through the block's loader under transformers' names: stacked, as
transformers 5 holds them in memory, and per expert, as save_pretrained writes checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from moe_cases import HIDDEN, MOE_CASES, randomize_
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.layers.moe import PACKED, RoutingConfig, SparseMoeBlock
from tokenmill.models.weights import CheckpointLoader, load_checkpoint


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_block_matches_transformers(case: str) -> None:
    moe = MOE_CASES[case]
    reference = moe.hf_block(moe.config).eval()
    randomize_(reference, seed=1)
    block = SparseMoeBlock(moe.config)
    load_checkpoint(block, reference.state_dict().items(), PACKED)
    x = _inputs(2)
    with torch.no_grad():
        expected = reference(x)
        actual = block(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


PER_EXPERT_CASES = [c for c in ("qwen2_moe", "qwen3_moe-renorm", "deepseek_v2-group_limited", "deepseek_v3", "kimi_linear")
                    if c in MOE_CASES]


@pytest.mark.parametrize("case", PER_EXPERT_CASES)
def test_block_loads_saved_checkpoint(case: str, tmp_path: Path) -> None:
    """A one-layer model saved by transformers (per-expert keys: experts.{i}.gate_proj / w1 ...)
    loads into the block, which then computes what the model's own layer computes."""
    moe = MOE_CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe.config).eval()
    layer = model.model.layers[0].mlp
    randomize_(layer, seed=3)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    prefixes = ("model.layers.0.mlp.", "model.layers.0.block_sparse_moe.")
    block_keys = {k.split(p, 1)[1]: v for k, v in saved.items() for p in prefixes if k.startswith(p)}
    assert any(".0." in f".{k}" and "experts." in k for k in block_keys), sorted(block_keys)  # per-expert on disk
    block = SparseMoeBlock(moe.config)
    load_checkpoint(block, block_keys.items(), PACKED)
    x = _inputs(4)
    with torch.no_grad():
        torch.testing.assert_close(block(x), layer(x), rtol=1e-5, atol=1e-6)


def test_loader_refuses_missing_unknown_and_misshapen_tensors() -> None:
    moe = MOE_CASES["qwen2_moe"]
    reference = moe.hf_block(moe.config)
    randomize_(reference, seed=1)
    weights = dict(reference.state_dict())
    block = SparseMoeBlock(moe.config)
    with pytest.raises(ModelLoadError, match="lacks 1 tensors .*shared_expert_gate.weight"):
        load_checkpoint(block, ((k, v) for k, v in weights.items() if k != "shared_expert_gate.weight"), PACKED)
    with pytest.raises(ModelLoadError, match="lacks 8 tensors .*experts.w13\\[0\\].up"):
        load_checkpoint(block, [(k, v) for k, v in weights.items() if k != "experts.gate_up_proj"]
                        + [(f"experts.{e}.gate_proj.weight", torch.zeros(16, HIDDEN)) for e in range(8)], PACKED)
    loader = CheckpointLoader(block, PACKED)
    with pytest.raises(ModelLoadError, match="'experts.3.fc1.weight' has no place"):
        loader.load("experts.3.fc1.weight", torch.zeros(1))
    with pytest.raises(ModelLoadError, match="'router.weight' has no place"):
        loader.load("router.weight", torch.zeros(1))
    with pytest.raises(ModelLoadError, match=r"experts.w2\[8\]|expert 8 is out of range"):
        loader.load("experts.8.down_proj.weight", torch.zeros(HIDDEN, 16))
    with pytest.raises(ModelLoadError, match=r"experts.w13\[2\] up: checkpoint shape \(16, 31\)"):
        loader.load("experts.2.up_proj.weight", torch.zeros(16, 31))


def test_per_expert_shards_land_in_their_rows() -> None:
    """gate / up / down of expert i (either naming) fill exactly w13[i, :I], w13[i, I:], w2[i]."""
    block = SparseMoeBlock(MOE_CASES["qwen3_moe"].config)
    loader = CheckpointLoader(block, PACKED)
    with torch.no_grad():
        block.experts.w13.zero_()
        block.experts.w2.zero_()
    loader.load("experts.5.gate_proj.weight", torch.full((16, HIDDEN), 1.0))
    loader.load("experts.5.w3.weight", torch.full((16, HIDDEN), 2.0))
    loader.load("experts.6.w2.weight", torch.full((HIDDEN, 16), 3.0))
    w13, w2 = block.experts.w13, block.experts.w2
    assert (w13[5, :16] == 1).all() and (w13[5, 16:] == 2).all() and w13[torch.arange(8) != 5].abs().sum() == 0
    assert (w2[6] == 3).all() and w2[torch.arange(8) != 6].abs().sum() == 0


def test_routing_config_from_checkpoint_field_names() -> None:
    """Kimi-Linear's checkpoint names (num_experts_per_token, moe_renormalize, num_expert_group)
    and DeepSeek's (n_routed_experts, topk_method, scoring_func) read as the same fields."""
    if "kimi_linear" in MOE_CASES:
        kimi = RoutingConfig.from_hf_config(MOE_CASES["kimi_linear"].config)
        assert kimi == RoutingConfig(num_experts=16, top_k=3, scoring="sigmoid", renormalize=True, n_group=4,
                                     topk_group=1, group_score="top2_sum", has_correction_bias=True,
                                     routed_scaling_factor=2.446, float32_logits=True)
    v2 = RoutingConfig.from_hf_config(MOE_CASES["deepseek_v2-group_limited"].config)
    assert (v2.scoring, v2.n_group, v2.topk_group, v2.group_score, v2.has_correction_bias) == ("softmax", 4, 2, "max", False)
    greedy = RoutingConfig.from_hf_config(MOE_CASES["deepseek_v2-greedy"].config)
    assert not greedy.grouped and greedy.routed_scaling_factor == 2.0
    qwen = RoutingConfig.from_hf_config(MOE_CASES["qwen3_moe-renorm"].config)
    assert qwen == RoutingConfig(num_experts=8, top_k=3, renormalize=True)


@pytest.mark.parametrize(
    "case,change,message",
    [
        ("deepseek_v2-greedy", {"norm_topk_prob": True}, "set norm_topk_prob = false"),
        ("deepseek_v2-greedy", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "score with sigmoid"),
        ("deepseek_v3", {"topk_group": 5}, "topk_group = 5 must be between 1 and n_group = 4"),
        ("deepseek_v3", {"n_group": 3}, "n_group = 3 must divide num_experts = 16"),
        ("deepseek_v3", {"n_group": 16, "topk_group": 8}, "'top2_sum' needs groups of at least two"),
        ("deepseek_v2-group_limited", {"topk_group": 1, "num_experts_per_tok": 5}, "top_k = 5 exceeds the 4 experts"),
        ("qwen3_moe", {"model_type": "mixtral"}, "no MoE routing is known for model_type 'mixtral'"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_unsupported_configs_fail_at_construction(case: str, change: dict, message: str) -> None:
    config = copy.deepcopy(MOE_CASES[case].config)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=message):
        SparseMoeBlock(config)

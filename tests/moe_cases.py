"""Tiny MoE configurations of every router kind, with transformers' own block for each: the
oracles of tests/layers/test_moe_block.py and the fused-block test in tests/kernels."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DeepseekV2Config, DeepseekV3Config, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

HIDDEN = 32
MOE_INTER = 16
# attention fields only so that a one-layer model of the config can be built and saved
ATTENTION = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, experts_implementation="eager")
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
KIMI_LAYERS = dict(mlp_layer_types=["sparse"], linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                                                     "kda_layers": [], "full_attn_layers": [1]})


@dataclass(frozen=True)
class MoeCase:
    config: PretrainedConfig
    hf_block: Callable[[PretrainedConfig], nn.Module]


def _qwen2(**kw: object) -> PretrainedConfig:
    return Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=24,
                          num_experts=8, num_experts_per_tok=2, **ATTENTION, **kw)


def _qwen3(**kw: object) -> PretrainedConfig:
    return Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, num_experts=8, num_experts_per_tok=3,
                          head_dim=16, **ATTENTION, **kw)


def _deepseek_v2(**kw: object) -> PretrainedConfig:
    return DeepseekV2Config(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, n_routed_experts=16, n_shared_experts=2,
                            first_k_dense_replace=0, q_lora_rank=None, **MLA, **ATTENTION, **kw)


def _deepseek_v3(**kw: object) -> PretrainedConfig:
    return DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, n_routed_experts=16, n_shared_experts=1,
                            first_k_dense_replace=0, q_lora_rank=16, **MLA, **ATTENTION, **kw)


def _kimi(**kw: object) -> PretrainedConfig:
    from transformers import KimiLinearConfig

    return KimiLinearConfig(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, num_experts=16, num_shared_experts=1,
                            **MLA, **ATTENTION, **KIMI_LAYERS, **kw)


MOE_CASES: dict[str, MoeCase] = {
    "qwen2_moe": MoeCase(_qwen2(norm_topk_prob=False), Qwen2MoeSparseMoeBlock),
    "qwen2_moe-renorm": MoeCase(_qwen2(norm_topk_prob=True), Qwen2MoeSparseMoeBlock),
    "qwen3_moe": MoeCase(_qwen3(norm_topk_prob=False), Qwen3MoeSparseMoeBlock),
    "qwen3_moe-renorm": MoeCase(_qwen3(norm_topk_prob=True), Qwen3MoeSparseMoeBlock),
    "qwen3_next": MoeCase(
        Qwen3NextConfig(hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=MOE_INTER,
                        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, **ATTENTION),
        Qwen3NextSparseMoeBlock),
    "deepseek_v2-greedy": MoeCase(
        _deepseek_v2(num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=2.0, mlp_bias=True), DeepseekV2Moe),
    "deepseek_v2-group_limited": MoeCase(
        _deepseek_v2(num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                     routed_scaling_factor=1.5), DeepseekV2Moe),
    "deepseek_v3": MoeCase(
        _deepseek_v3(num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
        DeepseekV3MoE),
    "deepseek_v3-ungrouped-no-renorm": MoeCase(
        _deepseek_v3(num_experts_per_tok=4, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
        DeepseekV3MoE),
}
if importlib.util.find_spec("transformers.models.kimi_linear"):  # newer than some transformers 5.x
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    MOE_CASES["kimi_linear"] = MoeCase(
        _kimi(num_experts_per_token=3, num_expert_group=4, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446),
        KimiLinearMoE)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> None:
    """Fill every parameter and buffer of an MoE block: routers scaled so that routing varies
    from token to token, correction biases large enough to change which experts win."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            scale = 0.3
        elif name.endswith("gate.weight"):
            scale = 1.0 / HIDDEN**0.5 * 2
        else:
            scale = 0.2
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale)

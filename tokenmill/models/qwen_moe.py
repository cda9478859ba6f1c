"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder with sparse MoE blocks in place of MLPs.

Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0,
else a dense MLP of `intermediate_size`. Qwen3-MoE: q/k norm like Qwen3, softmax top-k routing
with or without renormalisation (`norm_topk_prob`). Qwen2-MoE: q/k/v bias (`qkv_bias`), no o_proj
bias, and a shared expert gated per token by sigmoid(`shared_expert_gate`). Checkpoints hold the
experts per expert (`mlp.experts.{i}.gate_proj.weight`, as save_pretrained writes them) or stacked
(`mlp.experts.gate_up_proj`, transformers 5's in-memory layout); both load into the stacked
parameters (layers/moe/sparse_moe_block.py lists the names).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.moe import PACKED as MOE_PACKED
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.models.interface import ModelBuild
from tokenmill.models.llama import PACKED, LlamaForCausalLM, Variant, dense_mlp
from tokenmill.models.weights import PackedModules


def is_sparse_layer(config: PretrainedConfig, layer: int) -> bool:
    """transformers' rule for Qwen2-MoE and Qwen3-MoE."""
    return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


class QwenMoeForCausalLM(LlamaForCausalLM):
    """The decoder both families share: a sparse block or a dense MLP per layer."""

    packed: PackedModules = {**PACKED, **MOE_PACKED}

    def make_mlp(self, build: ModelBuild, layer: int, prefix: str) -> nn.Module:
        if is_sparse_layer(build.hf_config, layer):
            return SparseMoeBlock(build.hf_config, prefix, quant=build.quant, use_triton=build.use_triton)
        return dense_mlp(build, prefix)


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    variant = Variant(qk_norm=True)


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    def variant_of(self, config: PretrainedConfig) -> Variant:
        return Variant(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

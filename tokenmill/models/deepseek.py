"""DeepSeek-V2 / V3 (and Moonlight, a V3 config): multi-head latent attention over a paged latent
cache (tokenmill.layers.attention.mla), then a dense MLP or DeepSeek's MoE per layer.

Parameters carry Hugging Face names except the fused gate_up_proj and the stacked experts
(`packed`: the dense MLP's, then tokenmill.layers.moe's).
Rotary: V2 always rotates interleaved pairs; V3 as its `rope_interleave` says (neox halves when
false). YaRN with mscale changes the softmax scale (mla_softmax_scale).

Layer i's MLP is an MoE block when the config has routed experts, i >= first_k_dense_replace
and i % moe_layer_freq == 0 (DeepSeek's own rule; transformers' omits moe_layer_freq, which is
1 in every released config): tokenmill.layers.moe's SparseMoeBlock with DeepSeek's routing (V2:
softmax, greedy or group-limited top-k; V3: sigmoid with the correction bias, grouped top-k by
the two best scores of a group), routed scaling and n_shared_experts ungated shared experts.
V3's multi-token-prediction layers (`model.layers.{N}` and beyond, N = num_hidden_layers) are not
part of the forward: their tensors are skipped on load, and with the mtp speculative method
deepseek_mtp.py builds the head (`mtp_head`) and loads them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.attention.mla_backends import mla_backend
from tokenmill.layers.attention.mla_rotary import RopeStyle
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import PACKED as MOE_PACKED
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.decoder_stack import run_decoder_layers
from tokenmill.models.interface import CausalLM, ModelBuild, MTPHead
from tokenmill.models.llama import dense_mlp
from tokenmill.models.weights import PackedModules, load_checkpoint
from tokenmill.quantization.base import embedding

logger = logging.getLogger(__name__)

# checkpoint projection -> (fused module, shard)
PACKED: PackedModules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_moe_layer(config: PretrainedConfig, index: int) -> bool:
    experts = getattr(config, "n_routed_experts", None)
    first_dense = getattr(config, "first_k_dense_replace", None) or 0
    frequency = getattr(config, "moe_layer_freq", None) or 1
    return bool(experts) and index >= first_dense and index % frequency == 0


MlpFactory = Callable[[ModelBuild, int, str], nn.Module]
"""(build, layer index, module path) -> the layer's MLP."""


class DecoderLayer(nn.Module):
    def __init__(self, build: ModelBuild, rope: RopeStyle, index: int, make_mlp: MlpFactory) -> None:
        super().__init__()
        config = build.hf_config
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.self_attn = MLAAttention(
            config, rope, mla_backend(build.attention_backend.name), quant=build.quant, prefix=f"{prefix}.self_attn",
            block_size=build.block_size, cache_dtype=build.cache_dtype(), use_triton=build.use_triton,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.mlp = make_mlp(build, index, f"{prefix}.mlp")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to the residual stream (None at the start)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekModel(nn.Module):
    def __init__(self, build: ModelBuild, rope: RopeStyle, make_mlp: MlpFactory) -> None:
        super().__init__()
        config = build.hf_config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(build, rope, i, make_mlp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x, residual = run_decoder_layers(self.embed_tokens(input_ids), self.layers, ctx)
        return self.norm(x, residual)[0]


class DeepseekV2ForCausalLM(CausalLM):
    packed: PackedModules = {**PACKED, **MOE_PACKED}

    @staticmethod
    def rope_style(config: PretrainedConfig) -> RopeStyle:
        return "interleaved"

    def make_mlp(self, build: ModelBuild, index: int, prefix: str) -> nn.Module:
        """Layer `index`'s MLP: dense of intermediate_size, or DeepSeek's MoE block (routed experts
        of moe_intermediate_size plus n_shared_experts shared ones, all reading the same input)."""
        if is_moe_layer(build.hf_config, index):
            return SparseMoeBlock(build.hf_config, prefix, quant=build.quant, use_triton=build.use_triton)
        return dense_mlp(build, prefix)

    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        config = build.hf_config
        self.model = DeepseekModel(build, self.rope_style(config), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False,
                              method=build.quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def mtp_decoder_layer(self, build: ModelBuild, index: int) -> nn.Module:
        return DecoderLayer(build, self.rope_style(build.hf_config), index, self.make_mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = self.config.num_hidden_layers
        skipped_mtp: list[str] = []

        def skip(name: str) -> bool:
            layer = _LAYER.match(name)
            if layer and int(layer[1]) >= num_layers:
                skipped_mtp.append(name)
                return True
            return "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")

        load_checkpoint(self, weights, self.packed, skip)
        if skipped_mtp:
            logger.info("skipped %d tensors of the multi-token-prediction layers (model.layers.%d and beyond)",
                        len(skipped_mtp), num_layers)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def rope_style(config: PretrainedConfig) -> RopeStyle:
        return "interleaved" if getattr(config, "rope_interleave", True) else "neox"

    def mtp_head(self, build: ModelBuild) -> MTPHead:
        from tokenmill.models.deepseek_mtp import DeepseekMTP

        return DeepseekMTP(self, build)

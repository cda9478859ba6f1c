"""Llama-family decoder: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Parameters carry Hugging Face names except two fused projections (qkv_proj, gate_up_proj),
which load by shard (`PACKED`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.attention.paged_kv import PagedKVLayer
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.steering import ResidualSteering, SteeringStep, residual_add_norm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.weights import PackedModules, load_checkpoint
from tokenmill.quantization.base import embedding

# checkpoint projection -> (fused module, shard)
PACKED: PackedModules = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Variant:
    """What sets an architecture of the family apart, beyond its config numbers."""

    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    qkv_bias: bool | None = None  # Qwen2: always; None = config.attention_bias
    o_bias: bool | None = None  # Qwen2: never; None = config.attention_bias


class Attention(PagedKVLayer):
    """GQA attention over a paged KV cache (a cache layer: it declares its spec and is bound its tensor).
    A subclass may widen the query projection (`query_outputs` per head: a gate beside the query)
    and choose the q/k norm (`qk_norm`)."""

    query_outputs = 1
    qk_norm: type[RMSNorm] = RMSNorm

    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, variant: Variant, prefix: str) -> None:
        super().__init__()
        config, quant = build.hf_config, build.quant
        self.init_paged_kv(build.attention_backend, build.cache_dtype(), build.block_size, config.num_attention_heads,
                           config.num_key_value_heads, head_dim_of(config))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = bias if variant.o_bias is None else variant.o_bias
        self.qkv_proj = Linear(config.hidden_size, [self.query_outputs * self.q_size, self.kv_size, self.kv_size],
                               bias=qkv_bias, method=quant.linear_method(f"{prefix}.qkv_proj"))
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias, method=quant.linear_method(f"{prefix}.o_proj"))
        self.q_norm = self.qk_norm(self.head_dim, config.rms_norm_eps, build.use_triton) if variant.qk_norm else None
        self.k_norm = self.qk_norm(self.head_dim, config.rms_norm_eps, build.use_triton) if variant.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def launch_plan(self, metadata: AttentionMetadata) -> Hashable | None:
        """The attention launch plan of a step (None: the backend plans nothing on the host)."""
        plan = getattr(self.backend, "plan", None)
        if plan is None:
            return None
        return plan(metadata, sum(metadata.query_lens_host), self.num_heads, self.num_kv_heads, self.head_dim,
                    self.kv_cache.device, self.kv_dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        metadata = ctx.attention
        if self.rotary.use_triton and self.backend.attends_prewritten_cache:
            # One kernel rotates q and writes the rotated k and v into the cache (saves a launch per layer).
            self.rotary.rotate_into_cache(ctx.positions, q, k, v, self.kv_cache, metadata.slot_mapping,
                                          self.k_scale, self.v_scale)
            out = self.backend.attend(q, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale)
        else:
            q, k = self.rotary(ctx.positions, q, k)
            out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.flatten(1))


def dense_mlp(build: ModelBuild, prefix: str) -> GatedMLP:
    config = build.hf_config
    return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), build.quant,
                    prefix, build.use_triton)


MlpFactory = Callable[[ModelBuild, int, str], nn.Module]
"""(build, layer index, module path) -> the layer's MLP."""


class DecoderLayer(nn.Module):
    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, variant: Variant, prefix: str, mlp: nn.Module) -> None:
        super().__init__()
        config = build.hf_config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.self_attn = Attention(build, rotary, variant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, steer: SteeringStep | None = None,
        probe: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output (the embedding at the start), not yet added to the residual
        stream (None at the start). Every write passes `steer`; `probe` records the stream entering this layer."""
        x, residual = residual_add_norm(self.input_layernorm, x, residual, steer, probe)
        x = self.self_attn(x, ctx)
        x, residual = residual_add_norm(self.post_attention_layernorm, x, residual, steer)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, build: ModelBuild, variant: Variant, make_mlp: MlpFactory) -> None:
        super().__init__()
        config = build.hf_config
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        prefixes = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(build, rotary, variant, prefix, make_mlp(build, i, f"{prefix}.mlp")) for i, prefix in enumerate(prefixes)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.steering: ResidualSteering | None = None

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        steer = self.steering.step(ctx) if self.steering is not None else None
        for i, layer in enumerate(self.layers):
            if i in ctx.keep_hidden:  # the residual stream entering layer i
                ctx.hidden[i] = steer.stream(x, residual) if steer is not None else x if residual is None else x + residual
            x, residual = layer(x, residual, ctx, steer, probe=steer is not None and i == steer.layer)
        return residual_add_norm(self.norm, x, residual, steer)[0]


class LlamaForCausalLM(CausalLM):
    """Also Mistral (the same graph); Qwen2 and Qwen3 differ only in their Variant. A subclass may
    give its layers other MLPs (`make_mlp`) and pack more checkpoint names (`packed`)."""

    variant = Variant()
    packed: PackedModules = PACKED

    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        config = build.hf_config
        self.model = DecoderModel(build, self.variant_of(config), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False,
                              method=build.quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def variant_of(self, config: PretrainedConfig) -> Variant:
        return self.variant

    def graph_plan_key(self, metadata: AttentionMetadata) -> Hashable:
        """The attention layers' launch plans: the only choices this family's forward makes from the
        host lengths (its MLPs and MoE blocks see shapes alone)."""
        plans = [layer.self_attn.launch_plan(metadata) for layer in self.model.layers]
        if any(plan is None for plan in plans):
            return metadata.max_seq_len
        return tuple(dict.fromkeys(plans))

    def make_mlp(self, build: ModelBuild, layer: int, prefix: str) -> nn.Module:
        return dense_mlp(build, prefix)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    @property
    def residual_steering(self) -> ResidualSteering | None:
        return self.model.steering

    def set_residual_steering(self, steering: ResidualSteering) -> None:
        if steering.num_layers != len(self.model.layers):
            raise ConfigError(f"the steering direction is for {steering.num_layers} layers; this model has "
                              f"{len(self.model.layers)}")
        self.model.steering = steering

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def skip(name: str) -> bool:
            return "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")

        load_checkpoint(self, weights, self.packed, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = Variant(qk_norm=True)

"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet layers beside gated attention.

Layer i mixes tokens with Gated DeltaNet (layers/linear_attention) or with full attention as
`layer_types` says (transformers derives it from `full_attention_interval`: every 4th layer is
attention). Attention: q_proj emits each head's query and output gate side by side
([heads, 2 head_dim]), q/k norms, rotary on the first `partial_rotary_factor` of each head
(Qwen3.5's multimodal rope is plain rope for text, whose three position ids are equal), output
times sigmoid(gate) before o_proj. Every RMSNorm but the DeltaNet's gated one scales by (1 + w).
MLPs: Qwen3-Next picks sparse layers like Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`),
its MoE with a sigmoid-gated shared expert; Qwen3.5-MoE is sparse in every layer (its router
always renormalises); Qwen3.5 is dense.

Published Qwen3.5 checkpoints are multimodal (`Qwen3_5MoeForConditionalGeneration`): the text
model is served from `text_config`, its weights under `model.language_model.*`; the vision
tower (`model.visual.*`) is not loaded. The MTP head (`mtp.*`) is not part of the model: with the
mtp speculative method, qwen3_next_mtp.py builds it (`mtp_head`) and loads its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_attention import PACKED as GDN_PACKED
from tokenmill.layers.linear_attention import GatedDeltaNet, RecurrentBatch
from tokenmill.layers.moe import PACKED as MOE_PACKED
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.step_context import StepContext
from tokenmill.models.decoder_stack import run_decoder_layers
from tokenmill.models.interface import CausalLM, ModelBuild, MTPHead
from tokenmill.models.llama import PACKED, Attention, Variant, dense_mlp, head_dim_of
from tokenmill.models.qwen_moe import is_sparse_layer
from tokenmill.models.weights import PackedModules, load_checkpoint
from tokenmill.quantization.base import embedding

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


class GatedAttention(Attention):
    """Llama's paged GQA attention with a per-head output gate in q_proj, (1 + w) q/k norms and
    partial rotary (the rotary module's)."""

    query_outputs = 2
    qk_norm = ZeroCenteredRMSNorm

    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__(build, rotary, Variant(qk_norm=True), prefix)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(ctx.positions, q, k)
        out = self.attend(x, q, k, v.view(tokens, self.num_kv_heads, self.head_dim), ctx)
        return self.o_proj(out.flatten(1) * torch.sigmoid(gate.reshape(tokens, -1)))

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Write k, v into the cache and attend: [T, heads, head_dim]. x is the layer's input."""
        return self.backend.forward(q, k, v, self.kv_cache, ctx.attention, self.scale, self.k_scale, self.v_scale)


class HybridDecoderLayer(nn.Module):
    def __init__(self, build: ModelBuild, rotary: RotaryEmbedding, layer_type: str, prefix: str, mlp: nn.Module,
                 grouped_projections: bool) -> None:
        super().__init__()
        config = build.hf_config
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, f"{prefix}.linear_attn", build.quant,
                                             grouped_projections=grouped_projections, state_dtype=build.state_dtype,
                                             use_triton=build.use_triton)
        elif layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(build, rotary, f"{prefix}.self_attn")
        else:
            raise ConfigError(f"{prefix}: layer type {layer_type!r} is not linear_attention or full_attention")
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                recurrent: RecurrentBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to the residual stream (None at the start)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if recurrent is not None and hasattr(self, "linear_attn"):
            x = self.linear_attn(x, recurrent)
        else:
            x = self.self_attn(x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def layer_types(config: PretrainedConfig) -> list[str]:
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ConfigError(f"layer_types names {len(types)} layers but num_hidden_layers is {config.num_hidden_layers}")
    return types


def rotary_dim(config: PretrainedConfig) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * factor)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next: projections grouped per key head, Qwen3-MoE's choice of sparse layers."""

    grouped_projections = True
    packed: PackedModules = {**PACKED, **MOE_PACKED, **GDN_PACKED}

    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        config = build.hf_config
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton, rotary_dim(config))
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        types = layer_types(config)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(build, rotary, kind, f"model.layers.{i}", self.make_mlp(build, i, f"model.layers.{i}.mlp"),
                               self.grouped_projections)
            for i, kind in enumerate(types))
        self.has_recurrent_layers = LINEAR_ATTENTION in types
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, method=build.quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, build: ModelBuild, layer: int, prefix: str) -> nn.Module:
        if is_sparse_layer(build.hf_config, layer):
            return SparseMoeBlock(build.hf_config, prefix, quant=build.quant, use_triton=build.use_triton)
        return dense_mlp(build, prefix)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        recurrent = RecurrentBatch.of(ctx) if self.has_recurrent_layers else None
        x, residual = run_decoder_layers(self.embed_tokens(input_ids), self.layers, ctx, recurrent)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_head(self, build: ModelBuild) -> MTPHead:
        from tokenmill.models.qwen3_next_mtp import Qwen3NextMTP

        return Qwen3NextMTP(self, build)

    def mtp_decoder_layer(self, build: ModelBuild, prefix: str) -> nn.Module:
        """The MTP head's layer: full gated attention, the MLP this model gives layer index 0 (vLLM's)."""
        config = build.hf_config
        rotary = RotaryEmbedding(config, head_dim_of(config), build.max_model_len, build.use_triton, rotary_dim(config))
        return HybridDecoderLayer(build, rotary, FULL_ATTENTION, prefix, self.make_mlp(build, 0, f"{prefix}.mlp"),
                                  self.grouped_projections)

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under this module's names: the decoder's `model.` prefix dropped, the
        MTP head skipped."""
        for name, tensor in weights:
            if name.startswith("mtp.") or "rotary_emb" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            yield name.removeprefix("model."), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, self.checkpoint_names(weights), self.packed)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, ZeroCenteredRMSNorm):
                module.refresh()


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 / 3.6 MoE text model: separate q | k | v, z, b, a projections; every layer sparse."""

    grouped_projections = False

    def make_mlp(self, build: ModelBuild, layer: int, prefix: str) -> nn.Module:
        return SparseMoeBlock(build.hf_config, prefix, quant=build.quant, use_triton=build.use_triton)


class Qwen3_5ForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3.5 dense text model."""

    def make_mlp(self, build: ModelBuild, layer: int, prefix: str) -> nn.Module:
        return dense_mlp(build, prefix)


class _TextOfMultimodal:
    """A multimodal Qwen3.5 checkpoint served as text: its text_config, its language model's weights."""

    @classmethod
    def serving_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        text.architectures = list(config.architectures or [])
        return text

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        text = ((name.replace("model.language_model.", "model.", 1), t) for name, t in weights
                if not name.startswith(("model.visual.", "visual.")))
        return super().checkpoint_names(text)  # type: ignore[misc]


class Qwen3_5MoeForConditionalGeneration(_TextOfMultimodal, Qwen3_5MoeForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(_TextOfMultimodal, Qwen3_5ForCausalLM):
    pass

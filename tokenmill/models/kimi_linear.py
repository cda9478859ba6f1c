"""Kimi-Linear (`KimiLinearForCausalLM`): KDA layers beside NoPE MLA layers, a dense MLP or
DeepSeek-V3's MoE per layer.

    x = embed(ids);  per layer:  x += mixer(rmsnorm(x));  x += mlp(rmsnorm(x));  logits = lm_head(rmsnorm(x))

Layer i's token mixer is `layer_types[i]`: "linear_attention" is Kimi Delta Attention
(layers/linear_attention/kda.py, its state in per-request slots with snapshots and speculative
checkpoints as Gated DeltaNet's), "full_attention" is MLA without rotary embedding
(layers/attention/mla.py with rope None) over the paged latent cache. Checkpoints list the layers
1-indexed instead (`linear_attn_config.kda_layers` / `full_attn_layers`), which is read when
`layer_types` is absent. Layer i's MLP is `mlp_layer_types[i]` ("dense": intermediate_size;
"sparse": the MoE block with Kimi's router, sigmoid + correction bias, grouped top-k, routed
scaling, n_shared_experts ungated shared experts), else the first `first_k_dense_replace` layers
are dense (and, as the original code, every `moe_layer_freq`-th layer after them sparse).

Checkpoints: transformers' layout (`self_attn.conv1d`, `self_attn.forget_gate.*`,
`mlp.experts.gate_up_proj`) and the original one (`self_attn.q_conv1d` / `k_conv1d` /
`v_conv1d`, `self_attn.f_a_proj`, `self_attn.A_log`, `block_sparse_moe.*`, per-expert `w1` /
`w2` / `w3`). A config.json transformers cannot read (no `kimi_linear` in its version) is read
here with the checkpoint's field names. `models/raon.py` builds Raon-style models from these parts.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.attention.mla_backends import mla_backend
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_attention import KDA_PACKED, KimiDeltaAttention, RecurrentBatch
from tokenmill.layers.moe import PACKED as MOE_PACKED
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.decoder_stack import run_decoder_layers
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.llama import dense_mlp
from tokenmill.models.weights import PackedModules, load_checkpoint
from tokenmill.quantization.base import embedding

LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
_LAYER = re.compile(r"layers\.(\d+)\.")
# checkpoint field -> the name tokenmill's parts read (transformers' KimiLinearConfig maps them itself)
ALIASES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}


@dataclass(frozen=True)
class KimiLayout:
    """Per layer its token mixer (LINEAR: KDA, FULL: NoPE MLA) and MLP (DENSE, SPARSE); the KDA shape."""

    mixers: tuple[str, ...]
    mlps: tuple[str, ...]
    kda_heads: int
    kda_head_dim: int
    conv_width: int


def layers_from_one_indexed(lists: Mapping[str, tuple[str, Sequence[int]]], num_layers: int) -> list[str]:
    """Layer kinds from 1-indexed lists (`field -> (kind, layers)`): every layer named exactly once."""
    kinds: list[str | None] = [None] * num_layers
    for field, (kind, layers) in lists.items():
        for layer in layers:
            if not (isinstance(layer, int) and 1 <= layer <= num_layers):
                raise ConfigError(f"{field} lists layer {layer!r}: its layers are 1-indexed, 1..{num_layers}")
            if kinds[layer - 1] is not None:
                raise ConfigError(f"{field} lists layer {layer}, which another list names too")
            kinds[layer - 1] = kind
    missing = [i + 1 for i, kind in enumerate(kinds) if kind is None]
    if missing:
        raise ConfigError(f"layers {missing} (1-indexed) are in none of {', '.join(lists)}")
    return [kind for kind in kinds if kind is not None]


def _checked_types(field: str, types: Sequence[str], allowed: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    if len(types) != num_layers:
        raise ConfigError(f"{field} names {len(types)} layers but num_hidden_layers is {num_layers}")
    unknown = sorted(set(types) - set(allowed))
    if unknown:
        raise ConfigError(f"{field}: {', '.join(map(repr, unknown))} is not one of {', '.join(allowed)}")
    return tuple(types)


def kimi_layout(config: PretrainedConfig) -> KimiLayout:
    """The layer layout and KDA shape of a Kimi-Linear config (transformers' or the checkpoint's names)."""
    layers = config.num_hidden_layers
    linear = getattr(config, "linear_attn_config", None) or {}
    if getattr(config, "layer_types", None):
        mixers = _checked_types("layer_types", config.layer_types, (LINEAR, FULL), layers)
    elif "kda_layers" in linear and "full_attn_layers" in linear:
        mixers = tuple(layers_from_one_indexed({"linear_attn_config.kda_layers": (LINEAR, linear["kda_layers"]),
                                                "linear_attn_config.full_attn_layers": (FULL, linear["full_attn_layers"])},
                                               layers))
    else:
        raise ConfigError("the config names no layer layout: layer_types, or linear_attn_config's kda_layers and "
                          "full_attn_layers (1-indexed)")
    if getattr(config, "mlp_layer_types", None):
        mlps = _checked_types("mlp_layer_types", config.mlp_layer_types, (DENSE, SPARSE), layers)
    else:
        experts = _first(config, "n_routed_experts", "num_local_experts", "num_experts")
        first_dense = _first(config, "first_k_dense_replace")
        first_dense = 1 if first_dense is None else int(first_dense)  # transformers' default
        frequency = int(_first(config, "moe_layer_freq") or 1)
        mlps = tuple(SPARSE if experts and i >= first_dense and i % frequency == 0 else DENSE for i in range(layers))
    if getattr(config, "mla_use_nope", True) is False and FULL in mixers:
        raise ConfigError("mla_use_nope = false: Kimi-Linear's MLA layers are NoPE; rotary MLA is DeepSeek's")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"KDA convolves and the MLPs gate with SiLU; hidden_act {config.hidden_act!r} is not supported")
    if getattr(config, "use_grouped_topk", True) is False and int(_first(config, "n_group", "num_expert_group") or 1) > 1:
        raise ConfigError("use_grouped_topk = false with expert groups: transformers' Kimi router always groups")
    heads = _first(config, "linear_num_heads") or linear.get("num_heads")
    head_dim = _first(config, "linear_head_dim") or linear.get("head_dim")
    width = _first(config, "linear_conv_kernel_dim") or linear.get("short_conv_kernel_size")
    if LINEAR in mixers and not (heads and head_dim and width):
        raise ConfigError("KDA layers need linear_attn_config's num_heads, head_dim and short_conv_kernel_size")
    return KimiLayout(mixers, mlps, int(heads or 0), int(head_dim or 0), int(width or 0))


def _first(config: PretrainedConfig, *names: str) -> object:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def generic_config(raw: Mapping[str, object]) -> PretrainedConfig:
    """A config.json transformers has no class for, as a plain PretrainedConfig with the aliases
    tokenmill's parts read."""
    config = PretrainedConfig(**copy.deepcopy(dict(raw)))
    for field, alias in ALIASES.items():
        if field in raw and alias not in raw:
            setattr(config, alias, raw[field])
    return config


class KimiLayerParts(nn.Module):
    """A layer's token mixer (`linear_attn`: KDA, or `self_attn`: NoPE MLA) and its MLP (`mlp`)."""

    def __init__(self, build: ModelBuild, layout: KimiLayout, index: int) -> None:
        super().__init__()
        config, quant = build.hf_config, build.quant
        prefix = f"model.layers.{index}"
        if layout.mixers[index] == LINEAR:
            self.linear_attn = KimiDeltaAttention(
                config.hidden_size, layout.kda_heads, layout.kda_head_dim, layout.conv_width, config.rms_norm_eps,
                f"{prefix}.linear_attn", quant, state_dtype=build.state_dtype, use_triton=build.use_triton)
        else:
            self.self_attn = MLAAttention(
                config, None, mla_backend(build.attention_backend.name), quant=quant, prefix=f"{prefix}.self_attn",
                block_size=build.block_size, cache_dtype=build.cache_dtype(), use_triton=build.use_triton)
        if layout.mlps[index] == SPARSE:
            self.mlp: nn.Module = SparseMoeBlock(config, f"{prefix}.mlp", quant=quant, use_triton=build.use_triton)
        else:
            self.mlp = dense_mlp(build, f"{prefix}.mlp")

    def mix(self, x: torch.Tensor, ctx: StepContext, recurrent: RecurrentBatch | None) -> torch.Tensor:
        if hasattr(self, "linear_attn"):
            assert recurrent is not None
            return self.linear_attn(x, recurrent)
        return self.self_attn(x, ctx)


class KimiDecoderLayer(KimiLayerParts):
    def __init__(self, build: ModelBuild, layout: KimiLayout, index: int) -> None:
        super().__init__(build, layout, index)
        config = build.hf_config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext,
                recurrent: RecurrentBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to the residual stream (None at the start)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mix(x, ctx, recurrent)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class KimiLinearForCausalLM(CausalLM):
    packed: PackedModules = {**MOE_PACKED, **KDA_PACKED}

    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        config = build.hf_config
        self.layout = layout = self.layout_of(config)
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(build, layout, i) for i in range(config.num_hidden_layers))
        self.has_recurrent_layers = LINEAR in layout.mixers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, build.use_triton)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, method=build.quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def layout_of(cls, config: PretrainedConfig) -> KimiLayout:
        return kimi_layout(config)

    def make_layer(self, build: ModelBuild, layout: KimiLayout, index: int) -> nn.Module:
        return KimiDecoderLayer(build, layout, index)

    @classmethod
    def config_from_dict(cls, raw: dict) -> PretrainedConfig | None:
        """transformers' KimiLinearConfig where transformers has one; else the checkpoint's fields as they are."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if raw.get("model_type", "kimi_linear") in CONFIG_MAPPING:
            return None
        config = generic_config(raw)
        kimi_layout(config)
        return config

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        recurrent = RecurrentBatch.of(ctx) if self.has_recurrent_layers else None
        x, residual = run_decoder_layers(self.embed_tokens(input_ids), self.layers, ctx, recurrent)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under this module's names: `model.` dropped, the MoE block under
        `mlp.`, a KDA layer's tensors under `linear_attn.` (its forget gate's flattened)."""
        for name, tensor in weights:
            if "rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            name = name.removeprefix("model.")
            layer = _LAYER.match(name)
            if layer is not None and int(layer[1]) < len(self.layers):
                name = name.replace(".block_sparse_moe.", ".mlp.", 1)
                if self.layout.mixers[int(layer[1])] == LINEAR:
                    name = name.replace(".self_attn.", ".linear_attn.", 1).replace(".forget_gate.", ".", 1)
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, self.checkpoint_names(weights), self.packed)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.process_weights_after_loading()

"""Raon-style hybrids (`RaonForCausalLM`, the layout of KRAFTON's Raon-1-mini): Kimi-Linear's parts
(models/kimi_linear.py) with a residual of `hc_count` hyper-connection streams
(layers/hyper_connections.py) instead of one.

    streams = widen(embed(ids), hc_count)                                      [T, hc_count, hidden]
    per layer:  streams = attn_hyper_connection.around(streams, mixer)         RDA/KDA or NoPE MLA
                streams = mlp_hyper_connection.around(streams, mlp)            dense MLP or MoE
    hidden = norm(hyper_connection_mixer.mix(streams));  logits = lm_head(hidden)

The connections' stream norms are the layers' pre-norms (a layer has no input_layernorm or
post_attention_layernorm). Raon's code is not public and transformers has no class for it, so
this file defines what a Raon-style config.json may say (`FIELDS`, below) and reads it itself:
every field of the file must be one of them, with a value the parts run, or start-up fails
naming the field. The weights use Kimi-Linear's names (either checkpoint layout) plus
`model.layers.{i}.attn_hyper_connection.*`, `model.layers.{i}.mlp_hyper_connection.*` and
`model.hyper_connection_mixer.*`; a checkpoint laid out otherwise fails to load, naming a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.hyper_connections import HyperConnection
from tokenmill.layers.linear_attention import RecurrentBatch
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import ModelBuild
from tokenmill.models.kimi_linear import (
    FULL,
    LINEAR,
    KimiLayerParts,
    KimiLayout,
    KimiLinearForCausalLM,
    generic_config,
    kimi_layout,
    layers_from_one_indexed,
)

MODEL_TYPE = "raon"  # the routing family (layers/moe/routing.py) of the config built here

# Every field a Raon-style config.json may have, by what reads it. Aliases name one setting twice
# (the checkpoint's name and transformers'); fields marked "not read" do not change the forward.
FIELDS: dict[str, frozenset[str]] = {
    "identity (not read)": frozenset({"architectures", "model_type", "auto_map", "transformers_version", "torch_dtype",
                                      "dtype", "_name_or_path", "initializer_range", "use_cache", "attention_dropout",
                                      "head_dim", "rope_theta"}),
    "tokens and context": frozenset({"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
                                     "max_position_embeddings", "model_max_length", "tie_word_embeddings"}),
    "shape": frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act"}),
    "layer layout": frozenset({"layer_types", "linear_attn_config", "mlp_layer_types", "first_k_dense_replace",
                               "moe_layer_freq"}),
    "NoPE MLA": frozenset({"num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "attention_bias",
                           "rope_scaling", "rope_parameters"}),
    "MoE": frozenset({"num_experts", "n_routed_experts", "num_experts_per_token", "num_experts_per_tok",
                      "moe_intermediate_size", "num_shared_experts", "n_shared_experts", "moe_router_activation_func",
                      "scoring_func", "topk_method", "moe_renormalize", "norm_topk_prob", "routed_scaling_factor",
                      "num_expert_group", "n_group", "topk_group", "use_grouped_topk"}),
    "hyper-connections": frozenset({"hc_count", "hc_lowrank"}),
    "other parts of tokenmill": frozenset({"quantization_config", "num_nextn_predict_layers"}),
}
LINEAR_ATTN_FIELDS = frozenset({"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "rda_layers",
                                "full_attn_layers", "mla_layers"})
LAYER_KINDS = {"rda": LINEAR, "kda": LINEAR, LINEAR: LINEAR, "mla": FULL, FULL: FULL}
# 1-indexed layer lists of linear_attn_config and the token mixer each names
LAYER_LISTS = {"kda_layers": LINEAR, "rda_layers": LINEAR, "full_attn_layers": FULL, "mla_layers": FULL}
# What transformers' PretrainedConfig writes of its own into any config.json (not read here)
_GENERIC = frozenset(PretrainedConfig().to_dict()) | {"return_dict", "output_hidden_states", "output_attentions"}


def raon_config(raw: Mapping[str, object]) -> PretrainedConfig:
    """The config a Raon-style config.json describes, in Kimi-Linear's terms plus hc_count and
    hc_lowrank; ConfigError naming the first field it cannot run."""
    known = frozenset().union(*FIELDS.values()) | _GENERIC
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"Raon config: field(s) {', '.join(unknown)} are not supported (models/raon.py FIELDS lists "
                          "what a Raon-style config may say)")
    fields = dict(raw)
    linear = fields.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ConfigError(f"Raon config: linear_attn_config must be an object, got {linear!r}")
    unknown = sorted(set(linear) - LINEAR_ATTN_FIELDS)
    if unknown:
        raise ConfigError(f"Raon config: field(s) {', '.join('linear_attn_config.' + k for k in unknown)} are not "
                          "supported")
    layers = fields.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"Raon config: num_hidden_layers must be a positive integer, got {layers!r}")
    if fields.get("layer_types"):
        kinds = [LAYER_KINDS.get(kind) for kind in fields["layer_types"]]  # type: ignore[union-attr]
        if None in kinds:
            raise ConfigError(f"Raon config: layer_types {fields['layer_types']!r} may only name "
                              f"{', '.join(LAYER_KINDS)}")
        fields["layer_types"] = kinds
    else:
        lists = {f"linear_attn_config.{key}": (kind, linear[key]) for key, kind in LAYER_LISTS.items() if key in linear}
        if not lists:
            raise ConfigError("Raon config: no layer layout: layer_types, or linear_attn_config's 1-indexed "
                              f"{' / '.join(LAYER_LISTS)}")
        fields["layer_types"] = layers_from_one_indexed(lists, layers)
    _check_values(fields)
    config = generic_config({**fields, "model_type": MODEL_TYPE})
    config.linear_num_heads, config.linear_head_dim = linear.get("num_heads"), linear.get("head_dim")
    config.linear_conv_kernel_dim = linear.get("short_conv_kernel_size")
    kimi_layout(config)
    return config


def _check_values(fields: Mapping[str, object]) -> None:
    """The fields whose values the parts cannot run, refused by name (the rest are checked where read)."""
    for name in ("hc_count", "hc_lowrank"):
        value = fields.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"Raon config: {name} must be a positive integer, got {value!r}")
    if fields.get("mla_use_nope", True) is not True:
        raise ConfigError(f"Raon config: mla_use_nope {fields['mla_use_nope']!r}: its MLA layers are NoPE")
    for name in ("rope_scaling", "rope_parameters"):
        if fields.get(name):
            raise ConfigError(f"Raon config: {name} {fields[name]!r}: NoPE MLA layers have no rotary embedding")
    if fields.get("num_nextn_predict_layers"):
        raise ConfigError(f"Raon config: num_nextn_predict_layers {fields['num_nextn_predict_layers']!r}: "
                          "multi-token-prediction layers are not supported (use a draft model)")


class RaonDecoderLayer(KimiLayerParts):
    """Kimi-Linear's token mixer and MLP, each wrapped by a hyper-connection."""

    def __init__(self, build: ModelBuild, layout: KimiLayout, index: int) -> None:
        super().__init__(build, layout, index)
        config = build.hf_config
        self.attn_hyper_connection, self.mlp_hyper_connection = (
            HyperConnection(config.hidden_size, config.hc_count, config.hc_lowrank, config.rms_norm_eps,
                            quant=build.quant, prefix=f"model.layers.{index}.{name}")
            for name in ("attn_hyper_connection", "mlp_hyper_connection"))

    def forward(self, streams: torch.Tensor, ctx: StepContext, recurrent: RecurrentBatch | None) -> torch.Tensor:
        """streams [T, hc_count, hidden] -> the streams after this layer."""
        streams = self.attn_hyper_connection.around(streams, lambda x: self.mix(x, ctx, recurrent))
        return self.mlp_hyper_connection.around(streams, self.mlp)


class RaonForCausalLM(KimiLinearForCausalLM):
    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        config = build.hf_config
        self.hc_count = config.hc_count
        self.hyper_connection_mixer = HyperConnection(config.hidden_size, config.hc_count, config.hc_lowrank,
                                                      config.rms_norm_eps, inject=False, quant=build.quant,
                                                      prefix="model.hyper_connection_mixer")

    @classmethod
    def config_from_dict(cls, raw: dict) -> PretrainedConfig:
        return raon_config(raw)

    def make_layer(self, build: ModelBuild, layout: KimiLayout, index: int) -> nn.Module:
        return RaonDecoderLayer(build, layout, index)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        recurrent = RecurrentBatch.of(ctx) if self.has_recurrent_layers else None
        streams = HyperConnection.widen(self.embed_tokens(input_ids), self.hc_count)
        for i, layer in enumerate(self.layers):
            if i in ctx.keep_hidden:  # the streams entering layer i, side by side: [T, hc_count * hidden]
                ctx.hidden[i] = streams.flatten(1)
            streams = layer(streams, ctx, recurrent)
        return self.norm(self.hyper_connection_mixer.mix(streams)[0])

    def layer_output_entries(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """Refused: this model records each layer's hyper-connection streams ([T, hc_count * hidden]);
        which hidden state a block drafter's target_layer_ids tap (one stream, the mixed streams)
        is not determined from the public drafters."""
        raise ConfigError(f"target_layer_ids {list(layer_ids)}: a block drafter over {type(self).__name__}'s "
                          "hyper-connection streams taps a hidden state no public implementation determines; "
                          "tokenmill does not guess it")

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, ZeroCenteredRMSNorm):
                module.refresh()

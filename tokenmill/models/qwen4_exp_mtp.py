"""Qwen4Exp's MTP head (Qwen3.8-Flash-Next), as vLLM's qwen4_exp MTP (models/qwen4_exp/nvidia/
mtp.py) lays it out, the layout followed here; AMD's ATOM port agrees:

    e = fc_embedding(pre_fc_norm_embedding(embed(token at p + 1)))                  [T, H]
    s = fc_hidden(pre_fc_norm_hidden(h_p) as hc_count streams) + e in every stream   [T, hc, H]
    s = mtp.layers.0(s)     a QSA indexed-attention layer with MoE and hyper-connections, no PLE
    out = s                 the streams before the mixer: fed to the next chained step as h
    logits = lm_head(mtp.hyper_connection_mixer(out))     the head's own mixer, the target's head

h_p is the target's streams after its last layer, before its final mixer ([T, hc * H]: the
"pre-collapse" state). pre_fc_norm_hidden is one (1 + w) RMSNorm over all hc * H values of a
row, not one per stream (vLLM and ATOM; an MLX port measured a per-stream statistic as better,
so a checkpoint trained that way would draft worse here, never wrongly). fc_hidden is shared by
the streams. The mixer's `block_inject_weight`, which a mixer does not use, is skipped as vLLM
skips it. The config's `mtp` section may give the layer's rope_theta; a layout this file does
not know (more than one layer, dedicated embeddings, another tapped layer, another layer type,
other keys) is refused naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.hyper_connections import HyperConnection
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import MTP_HIDDEN, ModelBuild, MTPHead
from tokenmill.models.qwen3_next_mtp import mtp_layer_count, mtp_tensor_name
from tokenmill.models.weights import PackedModules, load_checkpoint

ATTENTION_KINDS = ("full_attention", "qwen_sparse_attention", "indexed_attention")  # the QSA layer, as configs name it
MTP_SECTION_KEYS = {"layer_types", "rope_theta", "mtp_use_hidden_state_from_layer"}
SKIPPED = ("hyper_connection_mixer.block_inject_weight",)


class Qwen4ExpTarget(Protocol):
    embed_tokens: nn.Embedding
    lm_head: nn.Module
    packed: PackedModules

    def mtp_decoder_layer(self, build: ModelBuild, prefix: str, rope_theta: float | None = None) -> nn.Module: ...


def mtp_rope_theta(config) -> float | None:
    """The MTP layer's rope_theta from the config's `mtp` section (None: the model's); refuses
    what the section sets that this head does not implement."""
    if mtp_layer_count(config) != 1:
        raise ConfigError("the checkpoint's config declares no MTP layer (mtp_num_hidden_layers is 0 or missing)")
    if getattr(config, "mtp_use_dedicated_embeddings", False):
        raise ConfigError("mtp_use_dedicated_embeddings: an MTP head with its own embedding is not supported")
    section = getattr(config, "mtp", None) or {}
    unknown = sorted(set(section) - MTP_SECTION_KEYS)
    if unknown:
        raise ConfigError(f"the config's mtp section sets {unknown}, which tokenmill's Qwen4Exp MTP head does not implement")
    if section.get("mtp_use_hidden_state_from_layer") is not None:
        raise ConfigError(f"mtp.mtp_use_hidden_state_from_layer = {section['mtp_use_hidden_state_from_layer']}: the head "
                          "reads the target's last streams only")
    kinds = list(section.get("layer_types", ["full_attention"]))
    if len(kinds) != 1 or kinds[0] not in ATTENTION_KINDS:
        raise ConfigError(f"mtp.layer_types = {kinds}: the Qwen4Exp MTP head is one QSA attention layer")
    return section.get("rope_theta")


class Qwen4ExpMTP(MTPHead):
    def __init__(self, target: Qwen4ExpTarget, build: ModelBuild) -> None:
        super().__init__(target.embed_tokens, target.lm_head)
        config, quant = build.hf_config, build.quant
        theta = mtp_rope_theta(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_size, self.hc_count = hidden, config.hc_count
        self.width = config.hc_count * hidden
        self.packed = target.packed
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps, build.use_triton)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(self.width, eps, build.use_triton)
        self.fc_embedding = Linear(hidden, hidden, bias=False, method=quant.linear_method("mtp.fc_embedding"))
        self.fc_hidden = Linear(hidden, hidden, bias=False, method=quant.linear_method("mtp.fc_hidden"))
        self.layers = nn.ModuleList([target.mtp_decoder_layer(build, "mtp.layers.0", theta)])
        self.hyper_connection_mixer = HyperConnection(hidden, config.hc_count, config.hc_lowrank, eps, inject=False,
                                                      quant=quant, prefix="mtp.hyper_connection_mixer")

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        tokens, n, hidden = input_ids.shape[0], self.hc_count, self.hidden_size
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(self.embed_tokens(input_ids)))
        normed = self.pre_fc_norm_hidden(ctx.token_inputs[MTP_HIDDEN]).reshape(tokens * n, hidden)
        streams = self.fc_hidden(normed).view(tokens, n, hidden) + embedded[:, None]
        for layer in self.layers:
            streams = layer(streams, input_ids, ctx, None)
        return streams.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hyper_connection_mixer.mix(hidden.view(-1, self.hc_count, self.hidden_size))[0])

    def owns(self, name: str) -> bool:
        return mtp_tensor_name(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = ((mtp_tensor_name(name), t) for name, t in weights)
        load_checkpoint(self, ((n, t) for n, t in named if n is not None and "rotary_emb" not in n and n not in SKIPPED),
                        self.packed)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, ZeroCenteredRMSNorm):
                module.refresh()

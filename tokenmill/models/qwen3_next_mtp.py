"""The MTP head of Qwen3-Next and Qwen3.5 (dense and MoE), as vLLM's qwen3_next_mtp.py /
qwen3_5_mtp.py lay it out (the layout followed here):

    x = fc(cat(pre_fc_norm_embedding(embed(token at p + 1)), pre_fc_norm_hidden(h_p)))    [H, 2H]
    x = mtp.layers.0(x)        a full-attention decoder layer (gated attention, the target's MLP kind)
    out = mtp.norm(x + residual)                                 fed to the next chained step as h
    logits = lm_head(out)                                        the target's head (and embedding)

h_p is the target's final hidden state after its norm (the forward's output); every norm is
(1 + w). The layer's MLP is what the target's `make_mlp` gives layer index 0 of the MTP stack
(vLLM reads the index from `mtp.layers.{i}`): MoE for MoE targets. Checkpoints store the head
as `mtp.*` (also beside `model.language_model.*` in multimodal Qwen3.5 checkpoints); the layer
count is `mtp_num_hidden_layers` (or `num_nextn_predict_layers`), and one layer is supported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import MTP_HIDDEN, ModelBuild, MTPHead
from tokenmill.models.weights import PackedModules, load_checkpoint

PREFIX = "mtp."
_CONTAINERS = ("model.language_model.", "language_model.", "model.")


def mtp_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name inside the MTP head (`mtp.` and what follows, also under a
    multimodal checkpoint's language-model prefix), or None for a tensor that is not the head's."""
    for container in _CONTAINERS:
        if name.startswith(container + PREFIX):
            name = name[len(container):]
            break
    return name[len(PREFIX):] if name.startswith(PREFIX) else None


def mtp_layer_count(config) -> int:
    """The MTP layers a Qwen-family config declares (0 when it names none); only 1 is served."""
    count = getattr(config, "mtp_num_hidden_layers", None)
    if count is None:
        count = getattr(config, "num_nextn_predict_layers", None) or 0
    if count > 1:
        raise ConfigError(f"the checkpoint's MTP head has {count} layers (mtp_num_hidden_layers); tokenmill runs "
                          "MTP heads of one layer")
    return int(count)


class QwenTarget(Protocol):
    """What the head takes of its Qwen3-Next-family target (models/qwen3_next.py)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Module
    packed: PackedModules

    def mtp_decoder_layer(self, build: ModelBuild, prefix: str) -> nn.Module:
        """A full-attention decoder layer of the target's kind (its MLP as for layer index 0)."""


class Qwen3NextMTP(MTPHead):
    def __init__(self, target: QwenTarget, build: ModelBuild) -> None:
        super().__init__(target.embed_tokens, target.lm_head)
        config, quant = build.hf_config, build.quant
        if mtp_layer_count(config) != 1:
            raise ConfigError("the checkpoint's config declares no MTP layer (mtp_num_hidden_layers is 0 or missing)")
        hidden = config.hidden_size
        self.width = hidden
        self.packed = target.packed
        eps = config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps, build.use_triton)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps, build.use_triton)
        self.fc = Linear(2 * hidden, hidden, bias=False, method=quant.linear_method(f"{PREFIX}fc"))
        self.layers = nn.ModuleList([target.mtp_decoder_layer(build, f"{PREFIX}layers.0")])
        self.norm = ZeroCenteredRMSNorm(hidden, eps, build.use_triton)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(ctx.token_inputs[MTP_HIDDEN])], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, None)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def owns(self, name: str) -> bool:
        return mtp_tensor_name(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = ((mtp_tensor_name(name), t) for name, t in weights)
        load_checkpoint(self, ((n, t) for n, t in named if n is not None and "rotary_emb" not in n), self.packed)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, ZeroCenteredRMSNorm):
                module.refresh()

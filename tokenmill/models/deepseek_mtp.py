"""DeepSeek-V3's multi-token-prediction layer (`num_nextn_predict_layers`, stored as the extra
decoder layer `model.layers.{N}`, N = num_hidden_layers), as vLLM's deepseek_mtp.py lays it out
(the layout followed here):

    e = embed(token at p + 1), zeroed at position 0             (vLLM masks the first position)
    x = eh_proj(cat(enorm(e), hnorm(h_p)))                      [H, 2H]
    x, residual = mtp_block(x)                                  an MLA decoder layer, MoE as layer N is
    out = x + residual                                          fed to the next chained step as h
    logits = lm_head(shared_head.norm(out))

h_p is the target's final hidden state after its norm. Norms are plain RMSNorm (weight, not
1 + weight). The checkpoint's `shared_head.head` and `embed_tokens` copies under layer N are the
target's own head and embedding (identical in DeepSeek-V3's release) and are not read: the head
shares the target's, as SGLang's NextN does. SGLang chains the normed output instead; vLLM's
pre-norm chaining is the DeepSeek-V3 report's (each MTP depth reads the previous depth's
representation, its output head carrying the norm).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import MTP_HIDDEN, ModelBuild, MTPHead
from tokenmill.models.weights import PackedModules, load_checkpoint

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
HEAD_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
TARGET_COPIES = ("shared_head.head.", "embed_tokens.")


class DeepseekTarget(Protocol):
    """What the head takes of its DeepSeek-V3 target (models/deepseek.py)."""

    lm_head: nn.Module
    packed: PackedModules

    @property
    def embedding(self) -> nn.Embedding: ...

    def mtp_decoder_layer(self, build: ModelBuild, index: int) -> nn.Module:
        """Decoder layer `index` of the target's kind (MLA; its MLP by DeepSeek's rule for that index)."""


class DeepseekMTP(MTPHead):
    def __init__(self, target: DeepseekTarget, build: ModelBuild) -> None:
        super().__init__(target.embedding, target.lm_head)
        config = build.hf_config
        count = getattr(config, "num_nextn_predict_layers", None) or 0
        if count != 1:
            raise ConfigError(f"num_nextn_predict_layers is {count}: tokenmill runs DeepSeek MTP with exactly one layer")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.index = config.num_hidden_layers
        self.width = hidden
        self.packed = target.packed
        prefix = f"model.layers.{self.index}"
        self.enorm = RMSNorm(hidden, eps, build.use_triton)
        self.hnorm = RMSNorm(hidden, eps, build.use_triton)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False, method=build.quant.linear_method(f"{prefix}.eh_proj"))
        self.mtp_block = target.mtp_decoder_layer(build, self.index)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, build.use_triton)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        embedded = torch.where((ctx.positions == 0)[:, None], torch.zeros_like(embedded), embedded)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(ctx.token_inputs[MTP_HIDDEN])], dim=-1))
        x, residual = self.mtp_block(x, None, ctx)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.shared_head.norm(hidden))

    def owns(self, name: str) -> bool:
        match = _LAYER.match(name)
        return match is not None and int(match[1]) == self.index

    def _names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _LAYER.match(name)
            if match is None or int(match[1]) != self.index:
                continue
            rest = match[2]
            if rest.startswith(TARGET_COPIES) or "rotary_emb" in rest:
                continue
            yield (rest if rest.startswith(HEAD_OWN) else f"mtp_block.{rest}"), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, self._names(weights), self.packed)

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        self.mtp_block.self_attn.process_weights_after_loading()

"""Hyper-connections: a residual of `hc_count` parallel streams instead of one, as a block any
decoder wraps its sublayers in.

A model threads its residual as [T, hc_count, hidden] through every layer: `widen` copies the
embedding into each stream, and each sublayer (token mixer, MLP: any map of one hidden state to
one) is wrapped by a `HyperConnection` of its own, `streams = hc.around(streams, sublayer)`.
Before the sublayer the connection reads the streams: it normalises each (RMSNorm scaled by
1 + weight, per stream), gates every stream's channels by sigmoid(W_up silu(W_down s / n)) (a rank
`lowrank` mixer over the concatenated streams) and averages the gated streams into the sublayer's
input; after it the output is added back to every stream i times 2 sigmoid(w_i . s / n). A final
mixer (`inject=False`) only contracts the streams into one hidden state, which the model may
normalise further. The layer knows nothing of the model around it: its sizes are arguments, its
parameters are named relative to where the model puts it. Qwen4Exp wraps its Gated DeltaNet /
QSA mixers and MoE this way (transformers' Qwen4ExpTextGatedResidual is the oracle), Raon-style
models (models/raon.py) their KDA / NoPE-MLA mixers and MLPs.

Parameter names are the checkpoint's: `hc_norm.weight` [n * hidden], `input_mix_weight_down`
[lowrank, n * hidden], `input_mix_weight_up` [n * hidden, lowrank], `block_inject_weight`
[n, n * hidden].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.quantization import QuantizationConfig, Unquantized


def stream_norm(hidden_size: int, hc_count: int, eps: float) -> ZeroCenteredRMSNorm:
    """RMSNorm of each stream of [..., hc_count, hidden], scaled by (1 + its part of the weight)."""
    return ZeroCenteredRMSNorm(hc_count * hidden_size, eps)


class HyperConnection(nn.Module):
    """`around(streams, block)` -> the streams after `block` wrapped by this connection; its two
    halves: `mix(streams)` -> (block input [T, hidden], injection weights [T, n] or None) and
    `inject(streams, block_output, weights)` -> the streams after the block."""

    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, *, inject: bool = True,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        quant = quant or Unquantized()
        self.hidden_size, self.hc_count = hidden_size, hc_count
        wide = hc_count * hidden_size

        def linear(name: str, in_features: int, out_features: int) -> Linear:
            return Linear(in_features, out_features, bias=False,
                          method=quant.linear_method(f"{prefix}.{name}" if prefix else name))

        self.hc_norm = stream_norm(hidden_size, hc_count, eps)
        self.input_mix_weight_down = linear("input_mix_weight_down", wide, lowrank)
        self.input_mix_weight_up = linear("input_mix_weight_up", lowrank, wide)
        self.block_inject_weight = linear("block_inject_weight", wide, hc_count) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, n, hidden]."""
        normed = self.hc_norm(streams)
        flat = normed.flatten(-2)
        gate = F.silu(self.input_mix_weight_down(flat) / self.hc_count)
        gate = torch.sigmoid(self.input_mix_weight_up(gate)).unflatten(-1, (self.hc_count, self.hidden_size))
        mixed = (gate * normed).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(flat) / self.hc_count)

    def around(self, streams: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """streams [T, n, hidden] -> the streams after block(mixed input [T, hidden]) -> [T, hidden]."""
        x, weights = self.mix(streams)
        if weights is None:
            raise ValueError("a final mixer (inject=False) contracts the streams: it wraps no block")
        return self.inject(streams, block(x), weights)

    @staticmethod
    def inject(streams: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [T, n, hidden] + block_output [T, hidden] weighted per stream by weights [T, n]."""
        return streams + block_output.unsqueeze(-2) * weights.unsqueeze(-1)

    @staticmethod
    def widen(hidden: torch.Tensor, hc_count: int) -> torch.Tensor:
        """The streams a model starts from: its embedding copied into each, [T, n, hidden]."""
        return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], hc_count, hidden.shape[-1]).contiguous()

"""Hyper-connections: a residual of `hc_count` parallel streams instead of one.

A model threads its residual as [T, hc_count, hidden] through every layer. Before each block a
`HyperConnection` reads the streams: it normalises each (RMSNorm scaled by 1 + weight, per
stream), gates every stream's channels by sigmoid(W_up silu(W_down s / n)) (a rank `hc_lowrank`
mixer over the concatenated streams) and averages the gated streams into the block's input; after
the block its output is added back to every stream i times 2 sigmoid(w_i . s / n). The final
mixer (`inject=False`) only contracts the streams into one hidden state. This is Qwen4Exp's
`Qwen4ExpTextGatedResidual`; Raon-style 4-stream residuals are the same parts configured.

Parameter names are the checkpoint's: `hc_norm.weight` [n * hidden], `input_mix_weight_down`
[lowrank, n * hidden], `input_mix_weight_up` [n * hidden, lowrank], `block_inject_weight`
[n, n * hidden].
"""

from __future__ import annotations

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
    """`mix(streams)` -> (block input [T, hidden], injection weights [T, n] or None);
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

    @staticmethod
    def inject(streams: torch.Tensor, block_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [T, n, hidden] + block_output [T, hidden] weighted per stream by weights [T, n]."""
        return streams + block_output.unsqueeze(-2) * weights.unsqueeze(-1)

    @staticmethod
    def widen(hidden: torch.Tensor, hc_count: int) -> torch.Tensor:
        """The streams a model starts from: its embedding copied into each, [T, n, hidden]."""
        return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], hc_count, hidden.shape[-1]).contiguous()

"""The gated MLP of Llama-family models (and of MoE layers' shared experts): down(silu(gate(x)) * up(x)),
gate and up fused into one projection (`gate_up_proj`, checkpoint shards gate_proj = 0, up_proj = 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.quantization.base import QuantizationConfig


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, quant: QuantizationConfig, prefix: str,
                 use_triton: bool = False) -> None:
        """use_triton: the fused SiLU-and-mul kernel (CUDA models)."""
        super().__init__()
        self.use_triton = use_triton
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                   method=quant.linear_method(f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, method=quant.linear_method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_triton:
            from tokenmill.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

"""The routed experts of a MoE layer, stacked, whose weights an experts method stores and applies.

    forward(x, topk_weights, topk_ids)[t] = sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])
    expert_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T

The unquantized method (tokenmill/quantization/unquantized_experts.py) holds w13 [E, 2I, H] (each
expert's gate rows, then its up rows) and w2 [E, H, I]; a quantized format is another
`FusedMoEMethod` with its own stacked parameters. Every parameter loads by (expert, projection)
shard through its weight loader, driven by models/weights.py's `load_checkpoint` (the checkpoint
names are in SparseMoeBlock.PACKED).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.base import FusedMoEMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        method: FusedMoEMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.method = method or UnquantizedFusedMoEMethod()
        self.method.create_weights(self, dtype or torch.get_default_dtype(), device)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None,
        addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H], topk_weights float32 [T, k], topk_ids int32 [T, k] -> [T, H]; plus addend [T, H]
        (a shared expert's output), times sigmoid(addend_gate [T, 1]) if given."""
        return self.method.apply(self, x, topk_weights, topk_ids, addend, addend_gate)

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) as float32."""
        return self.method.dequantized_weights(self)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"{self.method.name}")

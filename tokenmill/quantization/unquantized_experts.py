"""Routed experts in the model's dtype: stacked w13 [E, 2I, H] (each expert's gate rows, then its up
rows) and w2 [E, H, I]; activation SiLU-and-mul.

On CUDA (`use_triton`) the Triton kernels run (tokenmill/kernels/moe/experts.py: a few-row stream
over the selected experts for decode, grouped GEMMs over the expert-sorted tokens for prefill,
no host sync); otherwise `fused_experts_ref`, which sorts the tokens by expert and multiplies per
expert, in the order and precision of transformers' own experts loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.base import ExpertsLayer, FusedMoEMethod, default_uniform_, set_weight_loader
from tokenmill.quantization.weight_loading import stacked_experts_loader, stacked_experts_shards


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    name = "unquantized"

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    def create_weights(self, layer: ExpertsLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        w13 = default_uniform_(torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device), hidden**-0.5)
        w2 = default_uniform_(torch.empty(experts, hidden, inter, dtype=dtype, device=device), inter**-0.5)
        gate_up = stacked_experts_loader(experts, {"gate": (0, inter), "up": (inter, inter)})
        layer.register_parameter("w13", set_weight_loader(nn.Parameter(w13, requires_grad=False), gate_up,
                                                          shards=stacked_experts_shards(experts, ("gate", "up"))))
        down = stacked_experts_loader(experts, {"down": None})
        layer.register_parameter("w2", set_weight_loader(nn.Parameter(w2, requires_grad=False), down,
                                                         shards=stacked_experts_shards(experts, ("down",))))

    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w13, w2 = layer.w13, layer.w2  # type: ignore[attr-defined]
        if self.use_triton:
            from tokenmill.kernels.moe.experts import fused_experts

            return fused_experts(x, w13, w2, topk_weights, topk_ids, addend, addend_gate)
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, addend, addend_gate)

    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.w13.float(), layer.w2.float()  # type: ignore[attr-defined]


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    addend: torch.Tensor | None = None,
    addend_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: slots sorted by expert, one gate-up and one down matmul per expert that has
    any, each expert's weighted output added to its tokens in ascending expert order, in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = slice(start, start + count)
        start += count
        gate, up = F.linear(x[tokens[rows]], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens[rows], (y.float() * weights[rows, None]).to(x.dtype))
    if addend is not None:
        out = out + (addend if addend_gate is None else torch.sigmoid(addend_gate) * addend)
    return out


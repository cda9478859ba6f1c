"""Routed experts with FP8 E4M3 weights and block scales (every FP8-element format's experts).

Stacked as the unquantized method stacks them: w13 [E, 2I, H] (each expert's gate rows, then its
up rows) and w2 [E, H, I], in FP8, beside their scales w13_<scale> [E, rows, cols] and
w2_<scale> (named after the checkpoint's scale tensor: w13_weight_scale, w2_weight_scale_inv).
Each expert's gate, up and down load as (expert, projection) shards; a per-tensor scale becomes
its projection's rows' scale, so gate and up keep their own. Static input scales, where the
checkpoint has them, load into w13_input_scale [E, 2] and w2_input_scale [E, 1] and are kept
(the kernels multiply the dequantized weight by x in x's dtype).

On CUDA the MoE kernels (tokenmill/kernels/moe) read the FP8 weights with their scales; elsewhere
each expert with tokens is dequantized for its turn in the reference loop.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.numerics import FP8_E4M3, ScaleBlock, dequantize_blocks, scale_grid_shape
from tokenmill.quantization.base import ExpertsLayer, FusedMoEMethod, set_weight_loader
from tokenmill.quantization.scaled_fp8 import ScaleLayout, check_block_columns
from tokenmill.quantization.unquantized_experts import fused_experts_ref
from tokenmill.quantization.weight_loading import stacked_experts_loader, stacked_experts_shards

GATE_UP = ("gate", "up")


class DequantizedExperts:
    """Stacked FP8 experts that dequantize one expert at a time when indexed (the reference loop's view)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock, dtype: torch.dtype) -> None:
        self.weight, self.scale, self.block, self.dtype = weight, scale, block, dtype
        self.shape = weight.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_blocks(self.weight[expert], self.scale[expert], self.block).to(self.dtype)


def register_expert_input_scales(layer: ExpertsLayer, experts: int, device: torch.device | str | None) -> None:
    """w13_input_scale float32 [E, 2] (gate, up) and w2_input_scale [E, 1]: each expert projection's
    static per-tensor input scale, loaded per (expert, projection)."""

    def fit(tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        return tensor.float().reshape(-1)[:1].expand(dest.shape)

    for name, projections in (("w13", {"gate": (0, 1), "up": (1, 1)}), ("w2", {"down": None})):
        values = torch.ones(experts, 2 if name == "w13" else 1, dtype=torch.float32, device=device)
        loader = stacked_experts_loader(experts, projections, fit)
        layer.register_parameter(f"{name}_input_scale", set_weight_loader(
            nn.Parameter(values, requires_grad=False), loader, shards=stacked_experts_shards(experts, tuple(projections))))


class ScaledFp8FusedMoEMethod(FusedMoEMethod):
    def __init__(self, layout: ScaleLayout, prefix: str, use_triton: bool = False) -> None:
        self.layout = layout
        self.prefix = prefix
        self.use_triton = use_triton
        self.name = f"fp8 experts {layout.scale_name} {layout.block}"

    def create_weights(self, layer: ExpertsLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        check_block_columns(self.prefix, hidden, self.layout.block)
        check_block_columns(self.prefix, inter, self.layout.block)
        self._stack(layer, "w13", (experts, 2 * inter, hidden), {"gate": (0, inter), "up": (inter, inter)}, device)
        self._stack(layer, "w2", (experts, hidden, inter), {"down": None}, device)
        if self.layout.input_scale:
            register_expert_input_scales(layer, experts, device)

    def _stack(self, layer: ExpertsLayer, name: str, shape: tuple[int, int, int],
               projections: dict[str, tuple[int, int] | None], device: torch.device | str | None) -> None:
        experts, rows, cols = shape
        weight = torch.zeros(shape, dtype=FP8_E4M3, device=device)
        shards = stacked_experts_shards(experts, tuple(projections))
        layer.register_parameter(name, set_weight_loader(nn.Parameter(weight, requires_grad=False),
                                                         stacked_experts_loader(experts, projections), shards=shards))
        shard_rows = [size for _, size in (p for p in projections.values() if p is not None)] or [rows]
        block = self.layout.param_block(shard_rows)
        per_shard = scale_grid_shape(shard_rows[0], cols, block)[0]
        scale_rows = {p: (i * per_shard, per_shard) if span is not None else None
                      for i, (p, span) in enumerate(projections.items())}
        grid = (experts, per_shard * len(shard_rows), scale_grid_shape(rows, cols, block)[1])
        scale = torch.full(grid, 127 if self.layout.scale_dtype == torch.uint8 else 1, dtype=self.layout.scale_dtype,
                           device=device)
        loader = stacked_experts_loader(experts, scale_rows, self.layout.fit(block))
        layer.register_parameter(f"{name}_{self.layout.scale_name}",
                                 set_weight_loader(nn.Parameter(scale, requires_grad=False), loader, shards=shards))
        setattr(layer, f"{name}_scale_block", block)

    def scales(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor, ScaleBlock, ScaleBlock]:
        name = self.layout.scale_name
        return (getattr(layer, f"w13_{name}"), getattr(layer, f"w2_{name}"), layer.w13_scale_block,  # type: ignore[attr-defined]
                layer.w2_scale_block)  # type: ignore[attr-defined]

    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w13, w2 = layer.w13, layer.w2  # type: ignore[attr-defined]
        s13, s2, block13, block2 = self.scales(layer)
        if self.use_triton:
            from tokenmill.kernels.moe.experts import ExpertScales, fused_experts

            return fused_experts(x, w13, w2, topk_weights, topk_ids, addend, addend_gate,
                                 scales=ExpertScales(s13, s2, block13, block2))
        return fused_experts_ref(x, DequantizedExperts(w13, s13, block13, x.dtype),  # type: ignore[arg-type]
                                 DequantizedExperts(w2, s2, block2, x.dtype), topk_weights, topk_ids,  # type: ignore[arg-type]
                                 addend, addend_gate)

    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        s13, s2, block13, block2 = self.scales(layer)
        return dequantize_blocks(layer.w13, s13, block13), dequantize_blocks(layer.w2, s2, block2)  # type: ignore[attr-defined]

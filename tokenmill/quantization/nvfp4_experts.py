"""Routed experts with NVFP4 weights (quantization/nvfp4.py has the format).

Stacked as the unquantized method stacks them, packed two elements a byte: w13 uint8 [E, 2I, H / 2]
(each expert's gate rows, then its up rows) and w2 [E, H, I / 2], beside w13_weight_scale E4M3
[E, 2I, H / 16], w2_weight_scale [E, H, I / 16] and the global scales per row, w13_weight_scale_2
float32 [E, 2I] and w2_weight_scale_2 [E, H]: each (expert, projection)'s per-tensor scale over
its rows, so gate and up stay exact whether ModelOpt gave them one weight_scale_2 or two. Input
scales (NVFP4) load into w13_input_scale [E, 2] and w2_input_scale [E, 1], unused: the experts run
W4A16 on every device (W4A4 experts would quantize each expert's tokens under its own scale
between gate-up and down; not built).

On CUDA the MoE kernels (tokenmill/kernels/moe) decode the packed weights in registers;
elsewhere each expert with tokens is dequantized for its turn in the reference loop.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.numerics import NVFP4_GROUP, dequantize_nvfp4
from tokenmill.quantization.base import ExpertsLayer, FusedMoEMethod, set_weight_loader
from tokenmill.quantization.nvfp4 import check_group_columns, per_tensor_fit
from tokenmill.quantization.scaled_fp8_experts import register_expert_input_scales
from tokenmill.quantization.unquantized_experts import fused_experts_ref
from tokenmill.quantization.weight_loading import stacked_experts_loader, stacked_experts_shards


class DequantizedNvfp4Experts:
    """Stacked NVFP4 experts that dequantize one expert at a time when indexed (the reference loop's view)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight, self.scale, self.rows, self.dtype = weight, scale, rows, dtype
        self.shape = weight.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_nvfp4(self.weight[expert], self.scale[expert], self.rows[expert, :, None]).to(self.dtype)


class Nvfp4FusedMoEMethod(FusedMoEMethod):
    def __init__(self, prefix: str, input_scales: bool = True, use_triton: bool = False) -> None:
        self.prefix = prefix
        self.input_scales = input_scales
        self.use_triton = use_triton
        self.name = "nvfp4 experts w4a16"

    def create_weights(self, layer: ExpertsLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        experts, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate_size
        check_group_columns(self.prefix, hidden)
        check_group_columns(self.prefix, inter)
        self._stack(layer, "w13", (experts, 2 * inter, hidden), {"gate": (0, inter), "up": (inter, inter)}, device)
        self._stack(layer, "w2", (experts, hidden, inter), {"down": None}, device)
        if self.input_scales:
            register_expert_input_scales(layer, experts, device)

    @staticmethod
    def _stack(layer: ExpertsLayer, name: str, shape: tuple[int, int, int],
               projections: dict[str, tuple[int, int] | None], device: torch.device | str | None) -> None:
        experts, rows, cols = shape
        shards = stacked_experts_shards(experts, tuple(projections))
        tensors = {
            name: (torch.zeros(experts, rows, cols // 2, dtype=torch.uint8, device=device), None),
            f"{name}_weight_scale": (torch.ones(experts, rows, cols // NVFP4_GROUP, device=device).to(torch.float8_e4m3fn),
                                     None),
            f"{name}_weight_scale_2": (torch.ones(experts, rows, dtype=torch.float32, device=device), per_tensor_fit),
        }
        for param_name, (tensor, fit) in tensors.items():
            loader = stacked_experts_loader(experts, projections, fit)
            layer.register_parameter(param_name, set_weight_loader(nn.Parameter(tensor, requires_grad=False), loader,
                                                                   shards=shards))

    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w13, w2 = layer.w13, layer.w2  # type: ignore[attr-defined]
        s13, s2 = layer.w13_weight_scale, layer.w2_weight_scale  # type: ignore[attr-defined]
        r13, r2 = layer.w13_weight_scale_2, layer.w2_weight_scale_2  # type: ignore[attr-defined]
        if self.use_triton:
            from tokenmill.kernels.moe.experts import ExpertScales, fused_experts

            scales = ExpertScales(s13, s2, (1, NVFP4_GROUP), (1, NVFP4_GROUP), r13, r2)
            return fused_experts(x, w13, w2, topk_weights, topk_ids, addend, addend_gate, scales=scales)
        return fused_experts_ref(x, DequantizedNvfp4Experts(w13, s13, r13, x.dtype),  # type: ignore[arg-type]
                                 DequantizedNvfp4Experts(w2, s2, r2, x.dtype), topk_weights, topk_ids,  # type: ignore[arg-type]
                                 addend, addend_gate)

    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_nvfp4(layer.w13, layer.w13_weight_scale, layer.w13_weight_scale_2[..., None]),  # type: ignore[attr-defined]
                dequantize_nvfp4(layer.w2, layer.w2_weight_scale, layer.w2_weight_scale_2[..., None]))  # type: ignore[attr-defined]

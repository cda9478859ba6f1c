"""FP8 E4M3 weights with one float32 scale per output row.

Row n of the real weight = weight[n] * weight_scale[n]. `Fp8OnLoad` quantizes a high-precision
checkpoint as it loads (a draft model's `quantization: fp8`), routed experts too (each expert's
gate, up and down rows their own scales). On CUDA the linear layers multiply as an FP8 checkpoint
with per-row scales does (kernels/fp8_gemm.py, prefill "w8a8-rows"): one row weight-only, more
rows W8A8 with x quantized per token; the MoE kernels read the FP8 experts with their row scales
(weight-only). Elsewhere the weight is widened for the call a slab of rows (or one expert) at a
time.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.numerics import FP8_E4M3, FP8_E4M3_MAX, dequantize_blocks
from tokenmill.quantization.base import ExpertsLayer, FusedMoEMethod, LinearLayer, LinearMethod
from tokenmill.quantization.checkpoint import ROUTERS, excluded
from tokenmill.quantization.scaled_fp8 import dequantized_linear
from tokenmill.quantization.scaled_fp8_experts import DequantizedExperts
from tokenmill.quantization.unquantized import Unquantized, UnquantizedLinearMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod, fused_experts_ref

ROWS = (1, 0)  # one scale per weight row


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight as FP8 E4M3, float32 scale per row) with each row's largest magnitude at 448."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_E4M3_MAX
    return (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3), scale


class Fp8RowLinearMethod(UnquantizedLinearMethod):
    """Created like an unquantized weight, quantized to FP8 rows after loading."""

    name = "fp8-rows"

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        if layer.weight.dtype == FP8_E4M3:
            return
        quantized, scale = fp8_rows(layer.weight.detach())
        # A new parameter: a weight tied to another module (an embedding) keeps its dtype there.
        layer.weight = nn.Parameter(quantized, requires_grad=False)
        layer.register_buffer("weight_scale", scale)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if layer.weight.dtype != FP8_E4M3:  # not processed yet
            return super().apply(layer, x)
        if self.use_triton and x.dim() == 2 and x.is_contiguous():
            from tokenmill.kernels.fp8_gemm import scaled_fp8_linear

            return scaled_fp8_linear(x, layer.weight, layer.weight_scale, ROWS, layer.bias, "w8a8-rows")
        return dequantized_linear(x, layer.weight, layer.weight_scale[:, None], ROWS, layer.bias)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if layer.weight.dtype != FP8_E4M3:
            return layer.weight.float()
        return layer.weight.float() * layer.weight_scale[:, None]


class Fp8RowFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Routed experts created like unquantized ones, quantized to FP8 rows after loading: w13
    [E, 2I, H] and w2 [E, H, I] in E4M3 beside w13_weight_scale [E, 2I, 1] and w2_weight_scale [E, H, 1]."""

    name = "fp8-rows experts"

    def process_weights_after_loading(self, layer: ExpertsLayer) -> None:
        for name in ("w13", "w2"):
            weight = getattr(layer, name)
            if weight.dtype == FP8_E4M3:
                continue
            quantized, scale = fp8_rows(weight.detach().flatten(0, 1))
            setattr(layer, name, nn.Parameter(quantized.view(weight.shape), requires_grad=False))
            layer.register_buffer(f"{name}_weight_scale", scale.view(*weight.shape[:2], 1))

    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w13, w2 = layer.w13, layer.w2  # type: ignore[attr-defined]
        if w13.dtype != FP8_E4M3:  # not processed yet
            return super().apply(layer, x, topk_weights, topk_ids, addend, addend_gate)
        s13, s2 = layer.w13_weight_scale, layer.w2_weight_scale  # type: ignore[attr-defined]
        if self.use_triton:
            from tokenmill.kernels.moe.experts import ExpertScales, fused_experts

            return fused_experts(x, w13, w2, topk_weights, topk_ids, addend, addend_gate,
                                 scales=ExpertScales(s13, s2, ROWS, ROWS))
        return fused_experts_ref(x, DequantizedExperts(w13, s13, ROWS, x.dtype),  # type: ignore[arg-type]
                                 DequantizedExperts(w2, s2, ROWS, x.dtype), topk_weights, topk_ids,  # type: ignore[arg-type]
                                 addend, addend_gate)

    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = layer.w13, layer.w2  # type: ignore[attr-defined]
        if w13.dtype != FP8_E4M3:
            return w13.float(), w2.float()
        return (dequantize_blocks(w13, layer.w13_weight_scale, ROWS),  # type: ignore[attr-defined]
                dequantize_blocks(w2, layer.w2_weight_scale, ROWS))  # type: ignore[attr-defined]


class Fp8OnLoad(Unquantized):
    """Every linear layer (output head too, MoE routers aside) and every MoE layer's routed experts
    quantized to FP8 rows as the checkpoint loads."""

    name = "fp8"

    def linear_method(self, prefix: str) -> LinearMethod:
        if excluded(prefix, ROUTERS):
            return UnquantizedLinearMethod(self.use_triton)
        return Fp8RowLinearMethod(self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        return Fp8RowFusedMoEMethod(self.use_triton)


def quantize_fp8_(module: nn.Module) -> int:
    """Quantize every Linear in `module` (itself included) to FP8 rows now, keeping each layer's
    kernel choice; layers already FP8 stay as they are. Returns the number of layers."""
    layers = [m for m in module.modules() if isinstance(getattr(m, "method", None), LinearMethod)]
    for layer in layers:
        if not isinstance(layer.method, Fp8RowLinearMethod):
            layer.method = Fp8RowLinearMethod(getattr(layer.method, "use_triton", False))
        layer.method.process_weights_after_loading(layer)
    return len(layers)

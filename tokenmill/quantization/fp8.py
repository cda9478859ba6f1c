"""FP8 E4M3 weights with one float32 scale per output row (weight-only: x stays in its dtype).

Row n of the real weight = weight[n] * weight_scale[n]. `Fp8OnLoad` quantizes a high-precision
checkpoint as it loads (a draft model's `quantization: fp8`). On CUDA the few-row kernels read
the FP8 bytes for any number of rows (the FMA kernel up to its MAX_ROWS, the tensor-core kernel
past them); elsewhere the weight is widened for the call a slab of rows at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.numerics import FP8_E4M3, FP8_E4M3_MAX
from tokenmill.quantization.base import LinearLayer, LinearMethod, QuantizationConfig
from tokenmill.quantization.scaled_fp8 import dequantized_linear
from tokenmill.quantization.unquantized import Unquantized, UnquantizedLinearMethod


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
            from tokenmill.kernels.few_row_mma import fp8_linear
            from tokenmill.kernels.gemv import MAX_ROWS, gemv

            if x.shape[0] <= MAX_ROWS:
                return gemv(x, layer.weight, layer.bias, weight_scale=layer.weight_scale)
            return fp8_linear(x, layer.weight, layer.bias, weight_scale=layer.weight_scale)
        return dequantized_linear(x, layer.weight, layer.weight_scale[:, None], (1, 0), layer.bias)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if layer.weight.dtype != FP8_E4M3:
            return layer.weight.float()
        return layer.weight.float() * layer.weight_scale[:, None]


class Fp8OnLoad(Unquantized):
    """Every linear layer (output head too) quantized to FP8 rows as the checkpoint loads."""

    name = "fp8"

    def linear_method(self, prefix: str) -> LinearMethod:
        return Fp8RowLinearMethod(self.use_triton)

    experts_method = QuantizationConfig.experts_method  # no FP8 experts yet: MoE models are refused


def quantize_fp8_(module: nn.Module) -> int:
    """Quantize every Linear in `module` (itself included) to FP8 rows now, keeping each layer's
    kernel choice; layers already FP8 stay as they are. Returns the number of layers."""
    layers = [m for m in module.modules() if isinstance(getattr(m, "method", None), LinearMethod)]
    for layer in layers:
        if not isinstance(layer.method, Fp8RowLinearMethod):
            layer.method = Fp8RowLinearMethod(getattr(layer.method, "use_triton", False))
        layer.method.process_weights_after_loading(layer)
    return len(layers)

"""Linear layers: torch's matmul, except a few rows on CUDA, which stream the weight through
tokenmill's few-row kernel (decode at small batch is bound by reading the weights once).

A weight may be FP8 E4M3 with a float32 scale per output row (`quantize_fp8_`, weight-only:
activations stay in the model's dtype). The kernel reads the FP8 bytes; elsewhere (CPU, or more
rows than the kernel takes) the weight is dequantized for the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_E4M3 = torch.float8_e4m3fn
KERNEL_ROWS = 1
"""Most rows of x the kernel takes for an unquantized weight; above it torch's matmul (cuBLAS).
An FP8 weight goes through it up to the kernel's limit (gemv.MAX_ROWS), above that dequantized."""


class Linear(nn.Linear):
    weight_scale: torch.Tensor | None
    """float32 [out_features] when the weight is FP8: row n of the real weight = weight[n] * weight_scale[n]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, few_row_kernel: bool = False, **kwargs) -> None:
        """few_row_kernel: use the Triton kernel for inputs of up to KERNEL_ROWS rows (FP8 weights:
        up to the kernel's limit); CUDA models only."""
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.few_row_kernel = few_row_kernel
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_row_kernel and x.dim() == 2 and x.is_contiguous():
            from tokenmill.kernels.gemv import MAX_ROWS, gemv

            if x.shape[0] <= (MAX_ROWS if self.weight_scale is not None else KERNEL_ROWS):
                return gemv(x, self.weight, self.bias, weight_scale=self.weight_scale)
        if self.weight_scale is not None:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        return F.linear(x, self.weight, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as float32 (an FP8 weight times its row scales)."""
        if self.weight_scale is None:
            return self.weight.float()
        return self.weight.float() * self.weight_scale[:, None]

    @torch.no_grad()
    def quantize_fp8_(self) -> None:
        """Store the weight as FP8 E4M3, each output row scaled so its largest magnitude is 448.
        A weight shared with another module (a tied head) is copied, never quantized in place."""
        if self.weight_scale is not None:
            return
        quantized, self.weight_scale = fp8_rows(self.weight.detach())
        self.weight = nn.Parameter(quantized, requires_grad=False)


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight as FP8 E4M3, float32 scale per row) with each row's largest magnitude at 448."""
    w = weight.float()
    largest = torch.finfo(FP8_E4M3).max
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / largest
    return (w / scale[:, None]).clamp(-largest, largest).to(FP8_E4M3), scale


def quantize_fp8_(model: nn.Module) -> int:
    """Every Linear of the model to FP8 weights (weight-only, one scale per output row; embeddings
    and norms keep their dtype). Returns the number of layers quantized."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.quantize_fp8_()
    return len(layers)

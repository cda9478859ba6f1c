"""Weights in the model's dtype: torch's matmul, or on CUDA one of tokenmill's few-row kernels.

Decode at a small batch is bound by reading each weight once. One row of x goes through the
FMA kernel (gemv.py); up to MMA_ROWS rows through the tensor-core kernel (few_row_mma.py) where
it beats cuBLAS for the weight's shape; more rows through torch's matmul (cuBLAS).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quantization.base import (
    FusedMoEMethod,
    LinearLayer,
    LinearMethod,
    QuantizationConfig,
    default_uniform_,
    set_weight_loader,
)
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod
from tokenmill.quantization.weight_loading import output_rows_loader

FMA_ROWS = 1
"""Most rows of x the FMA kernel takes for an unquantized weight (from 2 rows it keeps too many
accumulators for the tensor-core kernel and cuBLAS to lose to it)."""


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def __init__(self, use_triton: bool = False) -> None:
        """use_triton: the few-row Triton kernels for inputs of up to MMA_ROWS rows (CUDA only)."""
        self.use_triton = use_triton

    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        weight = torch.empty(layer.out_features, layer.in_features, dtype=dtype, device=device)
        bound = 1 / math.sqrt(layer.in_features) if layer.in_features > 0 else 0.0
        default_uniform_(weight, bound)
        layer.weight = set_weight_loader(nn.Parameter(weight, requires_grad=False),
                                         output_rows_loader(layer.output_sizes), shards=layer.shards)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight
        if self.use_triton and x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype:
            from tokenmill.kernels.few_row_mma import MMA_ROWS, few_row_mma, few_row_mma_suits
            from tokenmill.kernels.gemv import gemv

            if x.shape[0] <= FMA_ROWS:
                return gemv(x, weight, layer.bias)
            if x.shape[0] <= MMA_ROWS and few_row_mma_suits(*weight.shape):
                return few_row_mma(x, weight, layer.bias)
        return F.linear(x, weight, layer.bias)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return layer.weight.float()


class Unquantized(QuantizationConfig):
    """Every layer in the checkpoint's (or the model's) dtype."""

    name = "none"

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod(self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        return UnquantizedFusedMoEMethod(self.use_triton)

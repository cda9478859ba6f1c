"""Linear layers: torch's matmul, except a single row on CUDA, which streams the weight through
tokenmill's one-row kernel (batch-1 decode is bound by reading the weights once)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, one_row_kernel: bool = False, **kwargs) -> None:
        """one_row_kernel: use the Triton kernel for [1, K] inputs (CUDA models only)."""
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.one_row_kernel = one_row_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_row_kernel and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():
            from tokenmill.kernels.gemv import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

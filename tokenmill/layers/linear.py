"""Linear layers: torch's matmul, except a few rows on CUDA, which stream the weight through one
of tokenmill's few-row kernels (decode at small batch is bound by reading the weights once): the
FMA kernel (gemv.py) for one row, the tensor-core one (few_row_mma.py) for up to 16.

A weight may be FP8 E4M3 with a float32 scale per output row (`quantize_fp8_`, weight-only:
activations stay in the model's dtype). On CUDA the kernels read the FP8 bytes for any number of
rows (the tensor-core kernel past the FMA kernel's rows); on a CPU the weight is dequantized for
the call, a slab of rows at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_E4M3 = torch.float8_e4m3fn
FMA_ROWS = 1
"""Most rows of x the FMA kernel takes for an unquantized weight (from 2 rows it keeps too many
accumulators); FP8 weights go through it up to all the rows it takes (gemv.MAX_ROWS), since the
tensor-core kernel widens FP8 slowly. Above these: unquantized weights take the tensor-core
kernel up to its MMA_ROWS where it beats cuBLAS, else torch's matmul (cuBLAS); FP8 weights take
the tensor-core kernel for any number of rows (fp8_linear), never a widened copy in memory."""


DEQUANT_ROWS = 4096
"""Rows of an FP8 weight widened at once where no kernel reads it (a CPU): a slab of 4096 x K
float32, not the whole weight."""


class Linear(nn.Linear):
    weight_scale: torch.Tensor | None
    """float32 [out_features] when the weight is FP8: row n of the real weight = weight[n] * weight_scale[n]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, few_row_kernel: bool = False, **kwargs) -> None:
        """few_row_kernel: use the Triton kernels for inputs of up to MMA_ROWS rows; CUDA models only."""
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.few_row_kernel = few_row_kernel
        self.register_buffer("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self.weight_scale is not None
        if self.few_row_kernel and x.dim() == 2 and x.is_contiguous() and (fp8 or x.dtype == self.weight.dtype):
            from tokenmill.kernels.few_row_mma import MMA_ROWS, few_row_mma, few_row_mma_suits, fp8_linear
            from tokenmill.kernels.gemv import MAX_ROWS, gemv

            if x.shape[0] <= (MAX_ROWS if fp8 else FMA_ROWS):
                return gemv(x, self.weight, self.bias, weight_scale=self.weight_scale)
            if fp8:
                return fp8_linear(x, self.weight, self.bias, weight_scale=self.weight_scale)
            if x.shape[0] <= MMA_ROWS and few_row_mma_suits(*self.weight.shape):
                return few_row_mma(x, self.weight, self.bias)
        if fp8:
            return self._dequantized_linear(x)
        return F.linear(x, self.weight, self.bias)

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for an FP8 weight, dequantized DEQUANT_ROWS rows at a time: a whole float32
        copy of a draft's head would be a transient of a gigabyte that the start-up memory
        profile (the target's largest step) never saw."""
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, DEQUANT_ROWS):
            rows = slice(start, start + DEQUANT_ROWS)
            weight = (self.weight[rows].float() * self.weight_scale[rows, None]).to(x.dtype)
            out[..., rows] = F.linear(x, weight, None if self.bias is None else self.bias[rows])
        return out

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

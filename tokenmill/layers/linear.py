"""Linear layers whose weight a quantization method stores and applies.

A layer may fuse several projections of the same input (q/k/v, gate/up): `output_sizes` lists
their widths, stacked along the output rows, and checkpoint tensor `shard` i loads into rows
`shard_rows(i)` of every row-indexed parameter. The bias is never quantized and belongs to the
layer itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from tokenmill.quantization.base import LinearMethod, default_uniform_, set_weight_loader
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.quantization.weight_loading import output_rows_loader


class Linear(nn.Module):
    """y = x @ W^T + b, with W held by `method` (plain weights when None)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        bias: bool = True,
        *,
        method: LinearMethod | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        sizes = [out_features] if isinstance(out_features, int) else list(out_features)
        self.in_features = in_features
        self.output_sizes = sizes
        self.out_features = sum(sizes)
        self.method = method or UnquantizedLinearMethod()
        dtype = dtype or torch.get_default_dtype()
        self.method.create_weights(self, dtype, device)
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            values = default_uniform_(torch.empty(self.out_features, dtype=dtype, device=device), bound)
            self.bias = set_weight_loader(nn.Parameter(values, requires_grad=False), output_rows_loader(sizes),
                                          shards=self.shards)
        else:
            self.register_parameter("bias", None)

    @property
    def shards(self) -> list[int] | None:
        """The checkpoint shards of a fused layer (None: one checkpoint tensor fills the layer)."""
        return list(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else None

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first output row, rows) of checkpoint shard `shard`."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the product uses, as float32 [out_features, in_features]."""
        return self.method.dequantized_weight(self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, {self.method.name}"

"""The quantization seam: a linear method owns how one linear layer stores and applies its weight.

A method creates the layer's parameters (each with a `weight_loader` that copies one checkpoint
tensor, or one shard of a fused projection, into place), post-processes them once every tensor
is loaded (e.g. quantizes a high-precision weight), and computes the product. A
`QuantizationConfig` picks the method of each layer by its name, so a checkpoint format is one
config plus its methods, and `Linear` has no format branches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | None"], None]
"""(parameter, checkpoint tensor, shard index or None for the whole parameter)."""


class LinearLayer(Protocol):
    """What a method sees of a linear layer (tokenmill.layers.linear.Linear)."""

    in_features: int
    out_features: int
    output_sizes: list[int]
    method: LinearMethod
    weight: nn.Parameter
    bias: nn.Parameter | None

    @property
    def shards(self) -> list[int] | None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class LinearMethod(ABC):
    """How a linear layer's weight is stored and multiplied."""

    name: str

    @abstractmethod
    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        """Register the layer's weight parameters (not the bias: Linear owns it)."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Called once after every checkpoint tensor is in place (idempotent)."""

    @abstractmethod
    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + bias."""

    @abstractmethod
    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        """The weight the product uses, as float32 [out_features, in_features]."""


class QuantizationConfig(ABC):
    """A checkpoint format (or an on-load conversion): the linear method of every layer."""

    name: str

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer named `prefix` (its module path in the model)."""


def set_weight_loader(param: nn.Parameter, loader: WeightLoader, **attrs: Any) -> nn.Parameter:
    """Attach a loader (and other load-time attributes) to a parameter."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    return param

"""The quantization seam: a linear method owns how one linear layer stores and applies its weight,
and an experts method how the stacked routed experts of a MoE layer store and apply theirs.

A method creates the layer's parameters (each with a `weight_loader` that copies one checkpoint
tensor, or one shard of it, into place), post-processes them once every tensor is loaded (e.g.
quantizes a high-precision weight), and computes the product. A `QuantizationConfig` picks the
method of each layer by its name, so a checkpoint format is one config plus its methods, and
`Linear` and `FusedMoE` have no format branches.

Shards: a fused projection's checkpoint tensor i loads as shard i; one expert's projection of
stacked experts loads as shard (expert, projection), e.g. (5, "gate"); None is the whole parameter.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError

Shard = int | tuple[int, str] | None
"""A fused projection's index, (expert, projection) of stacked experts, or None: the whole parameter."""

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Shard], None]
"""(parameter, checkpoint tensor, shard)."""

_DEFAULT_INIT = contextvars.ContextVar("tokenmill_default_init", default=True)


@contextlib.contextmanager
def weights_filled_later() -> Iterator[None]:
    """Inside it, layers skip their default random initialisation (nn.Linear's uniform, nn.Embedding's
    normal): for a model whose every parameter is loaded or filled next (`build_model`: the
    checkpoint loader fails on a parameter left unfilled), it would only cost time (0.7 s for a 135M
    model on two CPU cores)."""
    token = _DEFAULT_INIT.set(False)
    try:
        yield
    finally:
        _DEFAULT_INIT.reset(token)


def default_uniform_(tensor: torch.Tensor, bound: float) -> torch.Tensor:
    """nn.Linear's default initialisation, U(-bound, bound), unless weights are filled later."""
    return tensor.uniform_(-bound, bound) if _DEFAULT_INIT.get() else tensor


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding, N(0, 1)-initialised unless weights are filled later."""
    if _DEFAULT_INIT.get():
        return nn.Embedding(num_embeddings, embedding_dim)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))


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

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class LinearMethod(ABC):
    """How a linear layer's weight is stored and multiplied."""

    name: str

    @abstractmethod
    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        """Register the layer's weight parameters (not the bias: Linear owns it)."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Called once after every checkpoint tensor is in place (idempotent)."""

    def extra_weight_bytes(self, layer: LinearLayer) -> int:
        """Bytes that process_weights_after_loading adds to the parameters create_weights made (a
        second copy of the weight): start-up sizes the model with them. Called on a meta layer."""
        return 0

    @abstractmethod
    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + bias."""

    @abstractmethod
    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        """The weight the product uses, as float32 [out_features, in_features]."""


class ExpertsLayer(Protocol):
    """What an experts method sees of a MoE layer's routed experts (tokenmill.layers.moe.FusedMoE):
    num_experts experts of gate/up [2 * intermediate_size, hidden_size] and down [hidden_size,
    intermediate_size], activation SiLU-and-mul."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    method: FusedMoEMethod

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None: ...


class FusedMoEMethod(ABC):
    """How the routed experts of a MoE layer are stored and applied: every expert's weights stacked
    in a few parameters, loaded per (expert, projection) shard, multiplied for the selected experts only."""

    name: str

    @abstractmethod
    def create_weights(self, layer: ExpertsLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        """Register the stacked parameters; their weight loaders take (expert, "gate" | "up" | "down")
        shards of one expert's checkpoint tensor, and None for an already stacked tensor."""

    def process_weights_after_loading(self, layer: ExpertsLayer) -> None:
        """Called once after every checkpoint tensor is in place (idempotent)."""

    def extra_weight_bytes(self, layer: ExpertsLayer) -> int:
        """As LinearMethod.extra_weight_bytes."""
        return 0

    @abstractmethod
    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) (float32
        weights, int32 ids [T, k]), plus addend [T, H] (a shared expert's output), times
        sigmoid(addend_gate [T, 1]) if given."""

    @abstractmethod
    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) as float32: the weights the product uses."""


class QuantizationConfig(ABC):
    """A checkpoint format (or an on-load conversion): the linear method of every layer and the
    experts method of every MoE layer."""

    name: str

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method of the linear layer named `prefix` (its module path in the model)."""

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        """The method of the routed experts named `prefix`; a format without one refuses MoE models."""
        raise ConfigError(f"quantization {self.name!r} has no method for the routed experts of a MoE layer "
                          f"({prefix}); run this model unquantized")


def set_weight_loader(param: nn.Parameter, loader: WeightLoader, **attrs: Any) -> nn.Parameter:
    """Attach a loader (and other load-time attributes) to a parameter."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(param, key, value)
    return param

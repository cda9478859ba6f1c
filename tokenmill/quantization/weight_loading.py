"""Weight loaders shared by the quantization methods: whole tensors and row shards of fused layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quantization.base import WeightLoader


def copy_checked(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
    dest.copy_(tensor)


def whole_loader(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
    """One checkpoint tensor fills the parameter."""
    if shard is not None:
        raise ModelLoadError(f"shard {shard} of a parameter that takes one checkpoint tensor")
    copy_checked(param.data, tensor)


def output_rows_loader(output_sizes: Sequence[int]) -> WeightLoader:
    """Shard i fills rows [sum(sizes[:i]), +sizes[i]) along dim 0 (a layer with one output takes
    the whole tensor)."""
    sizes = list(output_sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: int | None) -> None:
        if shard is None:
            copy_checked(param.data, tensor)
        else:
            copy_checked(param.data.narrow(0, offsets[shard], sizes[shard]), tensor)

    return load

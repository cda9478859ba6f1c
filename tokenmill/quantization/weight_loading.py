"""Weight loaders shared by the quantization methods: whole tensors, row shards of fused layers,
and (expert, projection) shards of stacked experts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.numerics import FP8_E4M3
from tokenmill.quantization.base import Shard, WeightLoader

Fit = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(checkpoint tensor, destination slice) -> the tensor in the slice's shape (e.g. one per-tensor
scale spread over the rows of its shard), or a ModelLoadError."""

QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")
"""Checkpoint tensors of a quantized linear layer besides `weight`. Stacked experts keep them as
f"w13_{suffix}" and f"w2_{suffix}" (layers/moe/sparse_moe_block.py maps the per-expert names)."""

_STORED_CODES = (FP8_E4M3, torch.uint8)  # element or scale codes of a quantized format, not values


def copy_checked(dest: torch.Tensor, tensor: torch.Tensor, fit: Fit | None = None) -> None:
    """Copy a checkpoint tensor into place. Codes of a quantized format (FP8, packed uint8) load
    only into parameters of the same dtype and never into high-precision ones, which would
    silently take them for values: a layer the checkpoint's quantization config does not cover."""
    if (tensor.dtype in _STORED_CODES or dest.dtype in _STORED_CODES) and tensor.dtype != dest.dtype:
        raise ModelLoadError(f"the checkpoint stores {tensor.dtype} where the model's layer holds {dest.dtype}: "
                             "the checkpoint's quantization config does not describe this layer as it is stored")
    if fit is not None:
        tensor = fit(tensor, dest)
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
    dest.copy_(tensor)


def whole_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
    """One checkpoint tensor fills the parameter."""
    if shard is not None:
        raise ModelLoadError(f"shard {shard} of a parameter that takes one checkpoint tensor")
    copy_checked(param.data, tensor)


def output_rows_loader(output_sizes: Sequence[int], fit: Fit | None = None) -> WeightLoader:
    """Shard i fills rows [sum(sizes[:i]), +sizes[i]) along dim 0 (a layer with one output takes
    the whole tensor); `fit` shapes each tensor to its rows."""
    sizes = list(output_sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        if shard is None:
            copy_checked(param.data, tensor, fit)
        elif isinstance(shard, int) and 0 <= shard < len(sizes):
            copy_checked(param.data.narrow(0, offsets[shard], sizes[shard]), tensor, fit)
        else:
            raise ModelLoadError(f"shard {shard!r} of a layer fused from {len(sizes)} projections")

    return load


def stacked_experts_loader(
    num_experts: int, projections: Mapping[str, tuple[int, int] | None], fit: Fit | None = None
) -> WeightLoader:
    """For a parameter stacked over experts along dim 0: shard (e, projection) fills expert e's
    rows [start, start + rows) along dim 1 (`projections[name] = (start, rows)`), or its whole
    slice (None); shard None takes an already stacked tensor whole. `fit` shapes a shard's tensor."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        if shard is None:
            copy_checked(param.data, tensor)
            return
        if not (isinstance(shard, tuple) and shard[1] in projections):
            raise ModelLoadError(f"shard {shard!r} is not (expert, one of {', '.join(projections)})")
        expert, projection = shard
        if not 0 <= expert < num_experts:
            raise ModelLoadError(f"expert {expert} is out of range: the layer has {num_experts} experts")
        dest = param.data[expert]
        rows = projections[projection]
        copy_checked(dest if rows is None else dest.narrow(0, *rows), tensor, fit)

    return load


def stacked_experts_shards(num_experts: int, projections: Sequence[str]) -> list[Shard]:
    """Every shard a complete per-expert checkpoint fills in a stacked parameter."""
    return [(expert, projection) for expert in range(num_experts) for projection in projections]

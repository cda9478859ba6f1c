"""Loading a checkpoint into a model through its parameters' weight loaders.

A model names the fused projections it packs (`{"q_proj": ("qkv_proj", 0), ...}`: checkpoint
module -> (model module, shard)); every other tensor goes to the parameter of its own name. Each
parameter's `weight_loader` (set by its layer or quantization method) copies the tensor, or one
shard of it, into place; `shards` on a parameter lists the shards it expects. FP8 KV scales are
collected on the way (quantization/kv_scales.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quantization.kv_scales import CheckpointKVScales
from tokenmill.quantization.weight_loading import whole_loader

PackedModules = Mapping[str, tuple[str, int]]


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed: PackedModules,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every checkpoint tensor into its parameter; fail on a tensor without a place and on a
    parameter (or shard) the checkpoint leaves unfilled."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    kv_scales = CheckpointKVScales()
    with torch.no_grad():
        for name, tensor in weights:
            if skip(name) or kv_scales.take(name, tensor):
                continue
            target, shard = _locate(name, packed)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            try:
                getattr(param, "weight_loader", whole_loader)(param, tensor, shard)
            except ModelLoadError as error:
                raise ModelLoadError(f"{name}: {error}") from None
            loaded.add((target, shard))
    expected = {(n, s) for n, p in params.items() for s in (getattr(p, "shards", None) or [None])}
    missing = sorted(f"{n}:{s}" for n, s in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    kv_scales.apply(model)


def _locate(name: str, packed: PackedModules) -> tuple[str, int | None]:
    """(model parameter, shard of a fused projection or None) of a checkpoint tensor."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            parts[i], shard = packed[part]
            return ".".join(parts), shard
    return name, None

"""Loading a checkpoint into a model through its parameters' weight loaders.

A model names the checkpoint modules it packs into fused or stacked parameters (`packed`):

    "q_proj": ("qkv_proj", 0)                          shard 0 of the fused qkv_proj
    "experts.*.gate_proj.weight": ("experts.w13", "gate")
                                                       expert i's gate rows of the stacked w13:
                                                       shard (i, "gate"); `*` is the expert index
    "experts.gate_up_proj": ("experts.w13", None)      an already stacked tensor, whole
    "shared_experts": ("shared_expert", None)          a rename only

A key is one or more consecutive dotted parts of the checkpoint name; the name is read left to
right and each key found is replaced by its target (at most one of them may give a shard). Every
other tensor goes to the parameter of its own name. Each parameter's `weight_loader` (set by its
layer or quantization method) copies the tensor, or one shard of it, into place; `shards` on a
parameter lists the shards a complete checkpoint fills, and a whole tensor fills them all. FP8
KV scales are collected on the way (quantization/kv_scales.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.quantization.base import Shard
from tokenmill.quantization.kv_scales import CheckpointKVScales
from tokenmill.quantization.weight_loading import whole_loader

PackedModules = Mapping[str, tuple[str, int | str | None]]
EXPERT_INDEX = "*"


class CheckpointLoader:
    """Places checkpoint tensors one at a time (`load`), then checks that every parameter and
    shard was filled (`finish`)."""

    def __init__(self, model: nn.Module, packed: PackedModules, skip: Callable[[str], bool] = lambda name: False) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.skip = skip
        self.names = PackedNames(packed)
        self.loaded: set[tuple[str, Shard]] = set()
        self.kv_scales = CheckpointKVScales()

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        if self.skip(name) or self.kv_scales.take(name, tensor):
            return
        target, shard = self.locate(name)
        param = self.params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(self.model).__name__}")
        try:
            getattr(param, "weight_loader", whole_loader)(param, tensor, shard)
        except ModelLoadError as error:
            where = name if (target, shard) == (name, None) else f"{name} -> {_label(target, shard)}"
            raise ModelLoadError(f"{where}: {error}") from None
        if shard is None:
            self.loaded.update((target, s) for s in getattr(param, "shards", None) or [None])
        else:
            self.loaded.add((target, shard))

    def finish(self) -> None:
        expected = {(n, s) for n, p in self.params.items() for s in (getattr(p, "shards", None) or [None])}
        missing = sorted(_label(n, s) for n, s in expected - self.loaded)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors of {type(self.model).__name__}, "
                                 f"e.g. {missing[:3]}")
        self.kv_scales.apply(self.model)

    def locate(self, name: str) -> tuple[str, Shard]:
        """(model parameter, shard) of a checkpoint tensor."""
        return self.names.locate(name)


class PackedNames:
    """A model's packed names (see the module docstring): where each checkpoint tensor goes."""

    def __init__(self, packed: PackedModules) -> None:
        self.keys = sorted(((tuple(key.split(".")), value) for key, value in packed.items()), key=lambda kv: -len(kv[0]))

    def locate(self, name: str) -> tuple[str, Shard]:
        """(model parameter, shard) of a checkpoint tensor."""
        parts = name.split(".")
        out: list[str] = []
        shard: Shard = None
        i = 0
        while i < len(parts):
            found = self._match(parts, i)
            if found is None:
                out.append(parts[i])
                i += 1
                continue
            width, target, found_shard = found
            if found_shard is not None:
                if shard is not None:
                    raise ModelLoadError(f"checkpoint tensor {name!r} matches two packed projections")
                shard = found_shard
            out.extend(target.split("."))
            i += width
        return ".".join(out), shard

    def _match(self, parts: list[str], start: int) -> tuple[int, str, Shard] | None:
        """(parts matched, target, shard) of the longest key at parts[start:], else None."""
        for key, (target, shard) in self.keys:
            window = parts[start: start + len(key)]
            if len(window) != len(key):
                continue
            if all(k == p or (k == EXPERT_INDEX and p.isdigit()) for k, p in zip(key, window)):
                if EXPERT_INDEX in key:
                    return len(key), target, (int(window[key.index(EXPERT_INDEX)]), str(shard))
                return len(key), target, shard  # type: ignore[return-value]
        return None


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], packed: PackedModules,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy every checkpoint tensor into its parameter; fail on a tensor without a place and on a
    parameter (or shard) the checkpoint leaves unfilled."""
    loader = CheckpointLoader(model, packed, skip)
    for name, tensor in weights:
        loader.load(name, tensor)
    loader.finish()


def modules_by_target(model: type[nn.Module] | nn.Module, tensor_names: Iterable[str]) -> dict[str, list[str]]:
    """Model module path -> the checkpoint modules (a `.weight` tensor's name without it) that load
    into it, through the model's packed names: which checkpoint layers a fused or stacked model
    layer is made of, as a quantized checkpoint's config names them."""
    names = PackedNames(getattr(model, "packed", {}))
    found: dict[str, list[str]] = {}
    for name in tensor_names:
        if name.endswith(".weight"):
            target = names.locate(name)[0].rsplit(".", 1)[0]
            found.setdefault(target, []).append(name.removesuffix(".weight"))
    return found


def _label(target: str, shard: Shard) -> str:
    if shard is None:
        return target
    if isinstance(shard, tuple):
        return f"{target}[{shard[0]}] {shard[1]}"
    return f"{target}:{shard}"

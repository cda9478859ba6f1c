"""Cache specs: what each layer keeps, declared by the layer, sized and allocated from here once.

Two kinds exist. A paged spec keeps a fixed number of bytes per token in blocks of `block_size`
tokens; every paged layer of a model (and of its draft) shares the same block ids, so one block
id means `block_size` tokens in every paged layer, and a block's bytes are the sum over those
layers. A state spec keeps fixed-size tensors per running request (a recurrent state, a conv
window), in slots that do not grow with the context.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros; on the CPU over calloc'd memory (numpy's zeros), whose pages the OS maps in zeroed
    when first touched: a 1 GiB cache that a small model never fills costs nothing at start-up,
    where torch.zeros writes every byte (a second on two cores)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class CacheSpec(ABC):
    """What one layer caches."""


@dataclass(frozen=True)
class PagedCacheSpec(CacheSpec):
    """A fixed number of values per token, stored in blocks of block_size tokens."""

    block_size: int
    dtype: torch.dtype

    @abstractmethod
    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The cache tensor's shape for num_blocks blocks."""

    def bytes_per_block(self) -> int:
        return math.prod(self.shape(1)) * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        return zeros(self.shape(num_blocks), self.dtype, device)

    @abstractmethod
    def scaled_parts(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The views of a cache tensor that an FP8 cache scales separately, in the order of the
        layer's `kv_scales`."""


@dataclass(frozen=True)
class FullAttentionSpec(PagedCacheSpec):
    """Keys and values per KV head: [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_kv_heads: int
    head_dim: int

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def scaled_parts(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return cache[0], cache[1]  # keys (k_scale), values (v_scale)


@dataclass(frozen=True)
class LatentAttentionSpec(PagedCacheSpec):
    """One latent vector per token (MLA: the compressed KV and the rotary key part):
    [num_blocks, block_size, latent_dim], one FP8 scale for the whole row."""

    latent_dim: int

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    def scaled_parts(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (cache,)


@dataclass(frozen=True)
class IndexerKeySpec(PagedCacheSpec):
    """QSA's compressed index keys: one pooled key per `compress_ratio` tokens,
    [num_blocks, block_size // compress_ratio, head_dim], beside the layer's K/V under the same
    block ids (so a token's share is head_dim / compress_ratio values). Kept in the model dtype:
    the block scores decide the selection, and an FP8 cache is for the K/V only."""

    compress_ratio: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.block_size % self.compress_ratio:
            raise ValueError(f"block size {self.block_size} is not a multiple of the indexer's compress ratio "
                             f"{self.compress_ratio}")

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size // self.compress_ratio, self.head_dim)

    def scaled_parts(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]  # per request
    dtype: torch.dtype


@dataclass(frozen=True)
class RecurrentStateSpec(CacheSpec):
    """Fixed-size tensors per running request, in slots: each [num_slots, *shape].

    writes_checkpoints: the layer also writes the state after a row into the slot
    `StepContext.state_checkpoints` names for it. Speculative decoding (rollback to a draft
    position) and prefix snapshots need it; without it neither is offered."""

    tensors: tuple[StateTensor, ...]
    writes_checkpoints: bool = False

    def bytes_per_slot(self) -> int:
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors)

    def allocate(self, num_slots: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {t.name: zeros((num_slots, *t.shape), t.dtype, device) for t in self.tensors}


@runtime_checkable
class CacheLayer(Protocol):
    """A module that keeps a cache: it says what it needs, and is given the tensor(s) to use."""

    def cache_spec(self) -> CacheSpec: ...

    def bind_cache(self, cache: torch.Tensor | dict[str, torch.Tensor]) -> None: ...

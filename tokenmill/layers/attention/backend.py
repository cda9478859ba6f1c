"""The attention-backend seam: how layers read and write the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout: requests' new tokens are packed one after another.

    Request i owns query rows query_start_loc[i]:query_start_loc[i+1] (its newest tokens) and
    attends to its first seq_lens[i] tokens, whose KV live in blocks block_tables[i]. Host
    copies of the lengths ride along so no backend has to read them back from the device.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block * block_size + offset) per token
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)


class AttentionBackend(ABC):
    """Owns a KV layout and computes GQA attention over it (causal, or non-causal within a request's rows)."""

    name: str
    # True when `attend` reads a cache whose step was written by someone else (the fused rotary +
    # KV write kernel), so a layer may skip `forward`'s own write.
    attends_prewritten_cache: bool = False
    # True when attention streams the cache in place: a step's memory does not grow with the depth
    # of its keys (the memory profile then needs no step at max_model_len).
    reads_cache_in_place: bool = False

    @staticmethod
    def check_supported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Raise ConfigError, saying what to change, for a model this backend cannot run."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        causal: bool = True,
        window: int = 0,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's k, v into the cache, then attend.

        An FP8 cache stores k / k_scale and v / v_scale; reads multiply the scales back.
        causal=False: every query row of a request sees all of its seq_len keys (the rows of a
        block drafter's block attend to each other and to the context before them). window > 0:
        the row at position p sees no key below p - window + 1 (a sliding-window layer).
        """

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write keys and values into the cache without attending (a drafter's context rows)."""
        raise NotImplementedError(f"the {self.name} backend has no separate cache write")

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
               k_scale: float = 1.0, v_scale: float = 1.0, causal: bool = True, window: int = 0) -> torch.Tensor:
        """Attention over a cache that already holds this step's keys and values."""
        raise NotImplementedError(f"the {self.name} backend writes and attends in one call (forward)")

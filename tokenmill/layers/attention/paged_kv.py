"""A full-attention cache layer: keys and values per KV head in the paged cache
(FullAttentionSpec), bound by the runner, with the FP8 scales of quantization/kv_scales.py's
ScaledCacheLayer (stored value = k / k_scale, v / v_scale)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tokenmill.kv.specs import FullAttentionSpec
from tokenmill.layers.attention.backend import AttentionBackend
from tokenmill.quantization.kv_scales import key_value_scales


class PagedKVLayer(nn.Module):
    """Base of the attention layers that own a K/V cache; `init_paged_kv` in their __init__."""

    def init_paged_kv(self, backend: AttentionBackend, kv_dtype: torch.dtype, block_size: int, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> None:
        """Heads and cache layout, the backend checked for them, an unbound cache and unit scales."""
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_dtype, self.block_size, self.backend = kv_dtype, block_size, backend
        backend.check_supported(num_heads, num_kv_heads, head_dim, torch.get_default_dtype(), kv_dtype)
        self.kv_cache = torch.empty(0)  # bound by the runner
        self.k_scale = self.v_scale = 1.0
        # (k_scale, v_scale) as the checkpoint gives them; the runner applies them to an FP8 cache only.
        self.checkpoint_kv_scales: tuple[float, float] | None = None

    @property
    def kv_scales(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale

    @kv_scales.setter
    def kv_scales(self, scales: tuple[float, ...]) -> None:
        self.k_scale, self.v_scale = scales

    def scales_from_checkpoint(self, path: str, given: Mapping[str, float]) -> tuple[float, float]:
        return key_value_scales(path, given)

    def cache_spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(self.block_size, self.kv_dtype, self.num_kv_heads, self.head_dim)

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

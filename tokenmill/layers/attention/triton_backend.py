"""The Triton attention backend: KV write (with FP8 quantize-on-write) and paged attention for
any mix of prefill chunks and decodes, without a host synchronisation.

Triton is imported when the backend is built, never by `import tokenmill`.

FP8 KV (`--kv-cache-dtype fp8`): the cache tensor is `torch.float8_e4m3fn` and stores x / scale;
each layer's (k_scale, v_scale) is registered against its cache tensor with `set_kv_scales`
(default 1.0, 1.0). Scales are plain floats baked into each launch, so set them before any CUDA
graph is captured. For a cache of the model dtype the scales are ignored.
"""

from __future__ import annotations

import importlib

import torch

from tokenmill.errors import ConfigError
from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None, min_split_tokens: int | None = None) -> None:
        """num_splits: force the KV split count of every launch (None: chosen per batch).
        min_split_tokens: fewest keys of the longest request per split (None: 256 on CUDA)."""
        try:
            self._attention = importlib.import_module("tokenmill.kernels.attention")
            self._kv_cache = importlib.import_module("tokenmill.kernels.kv_cache")
        except ImportError as exc:
            raise ConfigError(f"--attention-backend triton needs triton ({exc}); pip install triton") from exc
        self.num_splits = num_splits
        self.min_split_tokens = min_split_tokens
        self._scales: dict[int, tuple[float, float]] = {}

    @staticmethod
    def check_supported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Fail at start-up, with what to change, on a model this backend cannot run."""
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"the triton attention backend runs bfloat16, float16 or float32, not {dtype}")
        if kv_dtype not in (dtype, FP8_KV_DTYPE):
            raise ConfigError(f"KV cache dtype {kv_dtype} must be the model dtype or float8_e4m3fn")
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} query heads do not split into {num_kv_heads} KV head groups")
        if not 16 <= head_dim <= 256:
            raise ConfigError(f"the triton attention backend takes head sizes 16..256, not {head_dim}")

    def set_kv_scales(self, kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
        if not (k_scale > 0 and v_scale > 0):
            raise ConfigError(f"KV cache scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
        self._scales[kv_cache.data_ptr()] = (float(k_scale), float(v_scale))

    def kv_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        if kv_cache.dtype != FP8_KV_DTYPE:
            return 1.0, 1.0
        return self._scales.get(kv_cache.data_ptr(), (1.0, 1.0))

    def plan(self, metadata: AttentionMetadata, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
        """The launch plan for this batch, from host-side sizes only."""
        return self._attention.plan_attention(
            num_tokens=num_tokens,
            num_requests=metadata.num_requests,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=device,
            num_splits=self.num_splits,
            min_split_tokens=self.min_split_tokens,
        )

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        k_scale, v_scale = self.kv_scales(kv_cache)
        self._kv_cache.write_kv_cache(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        num_tokens, num_heads, head_dim = q.shape
        plan = self.plan(metadata, num_tokens, num_heads, k.shape[1], head_dim, q.device)
        return self._attention.paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            plan,
            k_scale=k_scale,
            v_scale=v_scale,
        )

"""The Triton attention backend: KV write (with FP8 quantize-on-write) and paged attention for
any mix of prefill chunks and decodes, without a host synchronisation.

Triton is imported when the backend is built, never by `import tokenmill`.

FP8 KV (`--kv-cache-dtype fp8`): the cache tensor is `torch.float8_e4m3fn` and stores x / scale
(saturated at +-448) with the layer's k_scale and v_scale, which the caller passes to `forward`;
they are folded into the softmax scale and the output, so dequantizing costs nothing extra.
Scales are plain floats baked into each launch: fix them before CUDA graphs are captured.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import ConfigError
from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.kernels.attention import AttentionPlan

FP8_KV_DTYPE = torch.float8_e4m3fn
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    attends_prewritten_cache = True
    reads_cache_in_place = True

    def __init__(self, num_splits: int | None = None, min_split_tokens: int | None = None) -> None:
        """num_splits: force the KV split count of every launch (None: chosen per batch).
        min_split_tokens: fewest keys of the longest request per split (None: 64 on CUDA)."""
        try:
            self._attention = importlib.import_module("tokenmill.kernels.attention")
            self._kv_cache = importlib.import_module("tokenmill.kernels.kv_cache")
        except ImportError as exc:
            raise ConfigError(f"--attention-backend triton needs triton ({exc}); pip install triton") from exc
        self.num_splits = num_splits
        self.min_split_tokens = min_split_tokens

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

    def plan(
        self, metadata: AttentionMetadata, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
        device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
    ) -> AttentionPlan:
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
            kv_dtype=kv_dtype,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        causal: bool = True,
        window: int = 0,
    ) -> torch.Tensor:
        self.write(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return self.attend(q, kv_cache, metadata, scale, k_scale, v_scale, causal, window)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self._kv_cache.write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
               k_scale: float = 1.0, v_scale: float = 1.0, causal: bool = True, window: int = 0) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        plan = self.plan(metadata, num_tokens, num_heads, kv_cache.shape[3], head_dim, q.device, kv_cache.dtype)
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
            causal=causal,
            window=window,
        )

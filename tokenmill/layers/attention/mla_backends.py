"""The MLA kernel seam: how an MLA layer writes its latent cache and attends over it, by the
attention-backend name (`torch`: the plain-PyTorch reference, any device; `triton`: the kernels).

Both take the same inputs (see MLABackend) so the layer's projections, absorption and W_UV stay
in one place (tokenmill.layers.attention.mla). Triton is imported when the backend is built.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import mla_ref
from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.mla_rotary import MLARotary
from tokenmill.layers.attention.torch_ref import FP8
from tokenmill.layers.norm import RMSNorm

if TYPE_CHECKING:
    from tokenmill.kernels.mla_decode import AbsorbedPlan

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MLABackend(ABC):
    name: str

    @staticmethod
    def check_supported(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
        """Raise ConfigError, saying what to change, for a dtype pair this backend cannot run."""
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"MLA runs bfloat16, float16 or float32 models, not {dtype}")
        if cache_dtype not in (dtype, FP8):
            raise ConfigError(f"the latent cache dtype {cache_dtype} must be the model dtype or float8_e4m3fn "
                              "(--kv-cache-dtype fp8)")

    @abstractmethod
    def prepare(self, positions: torch.Tensor, q: torch.Tensor, compressed: torch.Tensor, norm: RMSNorm,
                rotary: MLARotary | None, cache: torch.Tensor, slot_mapping: torch.Tensor, cache_scale: float) -> None:
        """Normalise the latent of `compressed` ([T, kv_lora_rank + rope]), rotate its k_pe and q's
        rope part ([T, H, nope + rope], in place), and cache latent || k_pe (mla_ref.prepare_latents_ref)."""

    @abstractmethod
    def absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                 softmax_scale: float, cache_scale: float, out: torch.Tensor) -> torch.Tensor:
        """MQA of absorbed queries [T, H, kv_lora_rank] (+ q_pe) over the latent cache, into out."""

    @abstractmethod
    def upprojected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                    v: torch.Tensor, metadata: AttentionMetadata, kv_starts: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
        """Causal attention over the up-projected context (mla_ref.upprojected_attention_ref's layout)."""


class TorchMLABackend(MLABackend):
    name = "torch"

    def prepare(self, positions: torch.Tensor, q: torch.Tensor, compressed: torch.Tensor, norm: RMSNorm,
                rotary: MLARotary | None, cache: torch.Tensor, slot_mapping: torch.Tensor, cache_scale: float) -> None:
        mla_ref.prepare_latents_ref(positions, q, compressed, norm.weight, norm.eps, rotary, cache, slot_mapping, cache_scale)

    def absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                 softmax_scale: float, cache_scale: float, out: torch.Tensor) -> torch.Tensor:
        ref = mla_ref.absorbed_attention_ref(q_latent, q_pe, cache, metadata, softmax_scale, cache_scale)
        end = sum(metadata.query_lens_host)  # rows past every request (graph padding) stay as they are
        out[:end] = ref[:end].to(out.dtype)
        return out

    def upprojected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                    v: torch.Tensor, metadata: AttentionMetadata, kv_starts: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
        q = torch.cat((q_nope, q_pe), dim=-1)
        return mla_ref.upprojected_attention_ref(q, k_nope, k_pe, v, metadata, softmax_scale).to(q.dtype)


class TritonMLABackend(MLABackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None, block_h: int | None = None, block_q: int | None = None) -> None:
        """num_splits / block_h / block_q: force these of every absorbed launch (None: chosen per batch)."""
        try:
            self._decode = importlib.import_module("tokenmill.kernels.mla_decode")
            self._prefill = importlib.import_module("tokenmill.kernels.mla_prefill")
            self._cache = importlib.import_module("tokenmill.kernels.latent_cache")
        except ImportError as exc:
            raise ConfigError(f"--attention-backend triton needs triton ({exc}); pip install triton") from exc
        self.overrides = dict(num_splits=num_splits, block_h=block_h, block_q=block_q)

    def prepare(self, positions: torch.Tensor, q: torch.Tensor, compressed: torch.Tensor, norm: RMSNorm,
                rotary: MLARotary | None, cache: torch.Tensor, slot_mapping: torch.Tensor, cache_scale: float) -> None:
        self._cache.prepare_latents(
            positions, q, compressed, norm.weight, norm.eps, None if rotary is None else rotary.inv_freq,
            1.0 if rotary is None else rotary.attention_factor, rotary is not None and rotary.interleaved,
            cache, slot_mapping, cache_scale,
        )

    def plan(self, metadata: AttentionMetadata, num_tokens: int, num_heads: int, device: torch.device,
             cache_dtype: torch.dtype) -> AbsorbedPlan:
        """The absorbed launch plan for this batch, from host-side sizes only."""
        return self._decode.plan_absorbed(
            num_tokens=num_tokens, num_requests=metadata.num_requests, max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len, num_heads=num_heads, device=device, fp8_cache=cache_dtype == FP8,
            cache_bytes=cache_dtype.itemsize, **self.overrides,
        )

    def absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                 softmax_scale: float, cache_scale: float, out: torch.Tensor) -> torch.Tensor:
        plan = self.plan(metadata, q_latent.shape[0], q_latent.shape[1], q_latent.device, cache.dtype)
        return self._decode.absorbed_attention(
            q_latent, q_pe, cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
            softmax_scale, plan, cache_scale, out=out,
        )

    def upprojected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                    v: torch.Tensor, metadata: AttentionMetadata, kv_starts: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
        return self._prefill.upprojected_attention(
            q_nope, q_pe, k_nope, k_pe, v, metadata.query_start_loc, kv_starts, metadata.seq_lens, softmax_scale,
        )


MLA_BACKENDS: dict[str, type[MLABackend]] = {TorchMLABackend.name: TorchMLABackend, TritonMLABackend.name: TritonMLABackend}


def mla_backend(name: str) -> MLABackend:
    """The MLA backend of an --attention-backend name; an unknown one fails at start-up."""
    if name not in MLA_BACKENDS:
        raise ConfigError(f"MLA has no {name!r} attention backend; choose one of {sorted(MLA_BACKENDS)}")
    return MLA_BACKENDS[name]()

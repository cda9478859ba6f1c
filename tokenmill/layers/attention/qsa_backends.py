"""The QSA kernel seam: how an indexed-attention layer writes its K/V, scores its index blocks
and attends over the selected tokens, by the attention-backend name (`torch`: the plain-PyTorch
reference, any device; `triton`: the kernels). Both take the same inputs, so the layer's
projections, indexer and selection stay in one place (tokenmill.layers.attention.qsa).
Triton is imported when the backend is built.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import qsa_ref
from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.torch_ref import FP8, write_kv

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A long prefill's block scores are made a slice of query rows at a time: at most this many floats.
SCORE_ELEMENTS = 1 << 26


class QSABackend(ABC):
    name: str

    @staticmethod
    def check_supported(num_heads: int, num_kv_heads: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Raise ConfigError, saying what to change, for a layer this backend cannot run."""
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"QSA attention runs bfloat16, float16 or float32 models, not {dtype}")
        if kv_dtype not in (dtype, FP8):
            raise ConfigError(f"KV cache dtype {kv_dtype} must be the model dtype or float8_e4m3fn (--kv-cache-dtype fp8)")
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} query heads do not split into {num_kv_heads} KV head groups")

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float, v_scale: float) -> None:
        """This step's keys and values [T, Hkv, D] into the paged cache (FP8: stored / scale)."""

    @abstractmethod
    def select(self, q_index: torch.Tensor, index_cache: torch.Tensor, metadata: AttentionMetadata, ratio: int,
               block_topk: int) -> torch.Tensor:
        """[T, block_topk] int32: each query's best complete blocks, then -1 (the contract of qsa_ref)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, blocks: torch.Tensor,
               ratio: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
        """[T, H, D]: each query over its selected tokens (qsa_ref.sparse_attention_ref)."""


class TorchQSABackend(QSABackend):
    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float, v_scale: float) -> None:
        write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)

    def select(self, q_index: torch.Tensor, index_cache: torch.Tensor, metadata: AttentionMetadata, ratio: int,
               block_topk: int) -> torch.Tensor:
        return qsa_ref.select_blocks_ref(q_index, index_cache, metadata, ratio, block_topk)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, blocks: torch.Tensor,
               ratio: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
        return qsa_ref.sparse_attention_ref(q, kv_cache, metadata, blocks, ratio, scale, k_scale, v_scale)


class TritonQSABackend(QSABackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        """num_splits: force the split count of every sparse-attention launch (None: chosen per batch)."""
        try:
            self._index = importlib.import_module("tokenmill.kernels.qsa_index")
            self._sparse = importlib.import_module("tokenmill.kernels.sparse_attention")
            self._kv_cache = importlib.import_module("tokenmill.kernels.kv_cache")
        except ImportError as exc:
            raise ConfigError(f"--attention-backend triton needs triton ({exc}); pip install triton") from exc
        self.num_splits = num_splits

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: float, v_scale: float) -> None:
        self._kv_cache.write_kv_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)

    def select(self, q_index: torch.Tensor, index_cache: torch.Tensor, metadata: AttentionMetadata, ratio: int,
               block_topk: int) -> torch.Tensor:
        """Scores a slice of query rows at a time (at most SCORE_ELEMENTS floats), then torch.topk."""
        width = metadata.max_seq_len // ratio
        rows = max(1, SCORE_ELEMENTS // max(1, width))
        blocks = [qsa_ref.select_blocks(self._index.block_scores(
            q_index[first : first + rows], index_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables, ratio, width, first), block_topk) for first in range(0, q_index.shape[0], rows)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, blocks: torch.Tensor,
               ratio: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
        num_tokens, _, head_dim = q.shape
        plan = self._sparse.plan_sparse(num_tokens=num_tokens, num_kv_heads=kv_cache.shape[3], block_topk=blocks.shape[1],
                                        ratio=ratio, head_dim=head_dim, device=q.device, num_splits=self.num_splits)
        return self._sparse.sparse_paged_attention(q, kv_cache[0], kv_cache[1], blocks, metadata.query_start_loc,
                                                   metadata.seq_lens, metadata.block_tables, ratio, scale, plan,
                                                   k_scale, v_scale)


QSA_BACKENDS: dict[str, type[QSABackend]] = {TorchQSABackend.name: TorchQSABackend, TritonQSABackend.name: TritonQSABackend}


def qsa_backend(name: str) -> QSABackend:
    """The QSA backend of an --attention-backend name; an unknown one fails at start-up."""
    if name not in QSA_BACKENDS:
        raise ConfigError(f"QSA attention has no {name!r} attention backend; choose one of {sorted(QSA_BACKENDS)}")
    return QSA_BACKENDS[name]()

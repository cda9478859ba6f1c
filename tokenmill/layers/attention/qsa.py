"""QSA: Qwen4Exp's indexed sparse attention, over the paged K/V cache and a paged index-key cache.

The attention is Qwen3-Next's gated GQA (models/qwen4_exp.py's IndexedAttention), except that
each query attends only the tokens its indexer selects (this module). The indexer projects
index queries (indexer_n_heads heads) and one shared raw index key per token (`index_qk_proj`);
keys are mean-pooled over blocks of `indexer_compress_ratio` tokens, normalised and rotated at
the block's first position.
A query scores its complete blocks (sum over index heads of relu(q . k) / sqrt(D)), keeps the
indexer_budget / ratio best, and attends their tokens plus its own partial block
(qsa_ref.py states the contract, transformers' Qwen4ExpTextQSAIndexer is the oracle).

Caches: the K/V (`FullAttentionSpec`), the pooled keys (`IndexerKeySpec`, same block ids: one
row per `ratio` tokens, written once, when the block's last token is computed) and, per request,
the last ratio - 1 raw index keys (`IndexKeyWindow`, a state slot), so a block that closes in a
later step than it opened is pooled from the exact keys, and decode reads pooled keys from the
cache instead of recomputing them. An indexer without per-request state (`paged_raw_keys`: an
MTP head's, whose cache layers share the target's block tables and have no state slots) keeps
every raw key paged instead (`RawIndexKeys`, one per token): an index block lies inside one cache
block, so the keys a closing token pools sit in the slots just before its own; rolled back with
the rest of the paged cache (arithmetically).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import IndexerKeySpec, RecurrentStateSpec, StateTensor
from tokenmill.layers.attention.qsa_backends import QSABackend
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import ZeroCenteredRMSNorm
from tokenmill.layers.request_windows import RequestWindows
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.step_context import StepContext
from tokenmill.quantization import QuantizationConfig


class IndexKeyWindow(nn.Module):
    """A cache layer: each request's last ratio - 1 raw index keys, in its state slot."""

    def __init__(self, length: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = RecurrentStateSpec((StateTensor("index_keys", (length, head_dim), dtype),), writes_checkpoints=True)
        self.keys = torch.empty(0)  # [slots, ratio - 1, D], bound by the runner

    def cache_spec(self) -> RecurrentStateSpec:
        return self.spec

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.keys = cache["index_keys"]


class RawIndexKeys(nn.Module):
    """A cache layer: every token's raw index key, paged like the K/V."""

    def __init__(self, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = IndexerKeySpec(block_size, dtype, 1, head_dim)
        self.keys = torch.empty(0)  # [pages, block_size, D], bound by the runner

    def cache_spec(self) -> IndexerKeySpec:
        return self.spec

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.keys = cache


class QSAIndexer(nn.Module):
    """forward(x, ctx) -> blocks [T, block_topk]; writes the step's pooled keys first. A cache
    layer: the paged pooled keys (`index_cache`)."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: QSABackend, *,
                 quant: QuantizationConfig, prefix: str, block_size: int, use_triton: bool = False,
                 paged_raw_keys: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.block_topk = config.indexer_budget // self.ratio
        if config.indexer_kv_heads != 1:
            raise ConfigError(f"QSA takes one shared index key head, not indexer_kv_heads={config.indexer_kv_heads}")
        if block_size % self.ratio:
            raise ConfigError(f"--block-size {block_size} must be a multiple of indexer_compress_ratio {self.ratio} "
                              "(a cache block holds whole index blocks)")
        if rotary.rotary_dim > self.head_dim:
            raise ConfigError(f"the rotary dims ({rotary.rotary_dim}) do not fit the index head ({self.head_dim})")
        self.rotary, self.backend, self.block_size = rotary, backend, block_size
        self.index_qk_proj = Linear(config.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False,
                                    method=quant.linear_method(f"{prefix}.index_qk_proj"))
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, use_triton)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, use_triton)
        self.cache_dtype = torch.get_default_dtype()
        windowed = self.ratio > 1 and not paged_raw_keys
        self.window = IndexKeyWindow(self.ratio - 1, self.head_dim, self.cache_dtype) if windowed else None
        self.raw_keys = RawIndexKeys(block_size, self.head_dim, self.cache_dtype) if self.ratio > 1 and paged_raw_keys else None
        self.index_cache = torch.empty(0)  # [pages, block_size // ratio, D], bound by the runner

    def cache_spec(self) -> IndexerKeySpec:
        return IndexerKeySpec(self.block_size, self.cache_dtype, self.ratio, self.head_dim)

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.index_cache = cache

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, raw_keys = self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.rotary.rotate(ctx.positions, self.q_layernorm(q.reshape(num_tokens, self.num_heads, self.head_dim)))
        self.write_pooled_keys(raw_keys, ctx)
        return self.backend.select(q, self.index_cache, ctx.attention, self.ratio, self.block_topk)

    def write_pooled_keys(self, raw_keys: torch.Tensor, ctx: StepContext) -> None:
        """The pooled key of every block a token of this step closes, into its row of the cache
        (other tokens write to the scratch block's last row); the window keeps the latest keys."""
        raw_keys = raw_keys.contiguous()
        if self.raw_keys is not None:
            flat_keys = self.raw_keys.keys.view(-1, self.head_dim)
            flat_keys.index_copy_(0, ctx.attention.slot_mapping, raw_keys.to(flat_keys.dtype))
            back = torch.arange(self.ratio - 1, -1, -1, device=raw_keys.device)
            group = flat_keys[(ctx.attention.slot_mapping[:, None] - back).clamp(min=0)]  # oldest first
        elif self.window is None:
            group = raw_keys[:, None]
        else:
            windows = RequestWindows.of(ctx)
            length = self.ratio - 1
            ext = windows.extend(raw_keys, self.window.keys, 0.0)
            group = torch.stack([ext[windows.back(m, length)] for m in range(length, 0, -1)] + [raw_keys], dim=1)
            windows.store(self.window.keys, ext, length)
        pooled = self.k_layernorm(group.float().mean(dim=1).to(raw_keys.dtype))[:, None]
        positions = ctx.positions
        pooled = self.rotary.rotate((positions - (self.ratio - 1)).clamp(min=0), pooled)[:, 0]
        flat = self.index_cache.view(-1, self.head_dim)
        closes = (positions + 1) % self.ratio == 0
        rows = torch.where(closes, ctx.attention.slot_mapping // self.ratio, flat.shape[0] - 1)
        flat.index_copy_(0, rows, pooled.to(flat.dtype))

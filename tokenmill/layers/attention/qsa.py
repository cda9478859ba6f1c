"""QSA: Qwen4Exp's indexed sparse attention, over the paged K/V cache and a paged index-key cache.

The attention is Qwen3-Next's gated GQA (q_proj gives query and output gate interleaved per
head, zero-centred q/k norms, partial rotary, output times sigmoid(gate)), except that each query
attends only the tokens its indexer selects. The indexer projects index queries (indexer_n_heads
heads) and one shared raw index key per token (`index_qk_proj`); keys are mean-pooled over
blocks of `indexer_compress_ratio` tokens, normalised and rotated at the block's first position.
A query scores its complete blocks (sum over index heads of relu(q . k) / sqrt(D)), keeps the
indexer_budget / ratio best, and attends their tokens plus its own partial block
(qsa_ref.py states the contract, transformers' Qwen4ExpTextQSAIndexer is the oracle).

Caches: the K/V (`FullAttentionSpec`), the pooled keys (`IndexerKeySpec`, same block ids: one
row per `ratio` tokens, written once, when the block's last token is computed) and, per request,
the last ratio - 1 raw index keys (`IndexKeyWindow`, a state slot), so a block that closes in a
later step than it opened is pooled from the exact keys, and decode reads pooled keys from the
cache instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import FullAttentionSpec, IndexerKeySpec, RecurrentStateSpec, StateTensor
from tokenmill.layers.attention.qsa_backends import QSABackend, TorchQSABackend
from tokenmill.layers.attention.qsa_ref import select_blocks
from tokenmill.layers.hyper_connections import GroupedRMSNorm
from tokenmill.layers.linear import Linear
from tokenmill.layers.request_windows import RequestWindows
from tokenmill.layers.rotary import RotaryEmbedding, _rotate
from tokenmill.layers.step_context import StepContext
from tokenmill.quantization import QuantizationConfig, Unquantized
from tokenmill.quantization.kv_scales import key_value_scales

# Scores of a long prefill are made a slice of query rows at a time: at most this many floats.
SCORE_ELEMENTS = 1 << 26


class PartialRotary(nn.Module):
    """Rotate-half rotary over the first `dim` channels of every head, the rest left as is."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        self.dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(config, self.dim, max_positions)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at positions [T]."""
        cos = self.rotary.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rotary.sin[positions].unsqueeze(1).to(x.dtype)
        return torch.cat([_rotate(x[..., : self.dim], cos, sin), x[..., self.dim :]], dim=-1)


class IndexKeyWindow(nn.Module):
    """A cache layer: each request's last ratio - 1 raw index keys, in its state slot."""

    def __init__(self, length: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = RecurrentStateSpec((StateTensor("index_keys", (length, head_dim), dtype),))
        self.keys = torch.empty(0)  # [slots, ratio - 1, D], bound by the runner

    def cache_spec(self) -> RecurrentStateSpec:
        return self.spec

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.keys = cache["index_keys"]


class QSAIndexer(nn.Module):
    """forward(x, ctx) -> blocks [T, block_topk]; writes the step's pooled keys first. A cache
    layer: the paged pooled keys (`index_cache`)."""

    def __init__(self, config: PretrainedConfig, rotary: PartialRotary, backend: QSABackend, *,
                 quant: QuantizationConfig, prefix: str, block_size: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.block_topk = config.indexer_budget // self.ratio
        if config.indexer_kv_heads != 1:
            raise ConfigError(f"QSA takes one shared index key head, not indexer_kv_heads={config.indexer_kv_heads}")
        if block_size % self.ratio:
            raise ConfigError(f"--block-size {block_size} must be a multiple of indexer_compress_ratio {self.ratio} "
                              "(a cache block holds whole index blocks)")
        if rotary.dim > self.head_dim:
            raise ConfigError(f"the rotary dims ({rotary.dim}) do not fit the index head ({self.head_dim})")
        self.rotary, self.backend, self.block_size = rotary, backend, block_size
        self.index_qk_proj = Linear(config.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False,
                                    method=quant.linear_method(f"{prefix}.index_qk_proj"))
        self.q_layernorm = GroupedRMSNorm(self.head_dim, 1, config.rms_norm_eps)
        self.k_layernorm = GroupedRMSNorm(self.head_dim, 1, config.rms_norm_eps)
        self.cache_dtype = torch.get_default_dtype()
        self.window = IndexKeyWindow(self.ratio - 1, self.head_dim, self.cache_dtype) if self.ratio > 1 else None
        self.index_cache = torch.empty(0)  # [pages, block_size // ratio, D], bound by the runner

    def cache_spec(self) -> IndexerKeySpec:
        return IndexerKeySpec(self.block_size, self.cache_dtype, self.ratio, self.head_dim)

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.index_cache = cache

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, raw_keys = self.index_qk_proj(x).split([self.num_heads * self.head_dim, self.head_dim], dim=-1)
        q = self.rotary(ctx.positions, self.q_layernorm(q.reshape(num_tokens, self.num_heads, self.head_dim)))
        self.write_pooled_keys(raw_keys, ctx)
        metadata = ctx.attention
        rows = max(1, SCORE_ELEMENTS // max(1, metadata.max_seq_len // self.ratio))
        blocks = [select_blocks(self.backend.block_scores(q[first : first + rows], self.index_cache, metadata,
                                                          self.ratio, first), self.block_topk)
                  for first in range(0, num_tokens, rows)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def write_pooled_keys(self, raw_keys: torch.Tensor, ctx: StepContext) -> None:
        """The pooled key of every block a token of this step closes, into its row of the cache
        (other tokens write to the scratch block's last row); the window keeps the latest keys."""
        raw_keys = raw_keys.contiguous()
        if self.window is None:
            group = raw_keys[:, None]
        else:
            windows = RequestWindows.of(ctx)
            length = self.ratio - 1
            ext = windows.extend(raw_keys, self.window.keys, 0.0)
            group = torch.stack([ext[windows.back(m, length)] for m in range(length, 0, -1)] + [raw_keys], dim=1)
            windows.store(self.window.keys, ext, length)
        pooled = self.k_layernorm(group.float().mean(dim=1).to(raw_keys.dtype)[:, None])
        positions = ctx.positions
        pooled = self.rotary((positions - (self.ratio - 1)).clamp(min=0), pooled)[:, 0]
        flat = self.index_cache.view(-1, self.head_dim)
        closes = (positions + 1) % self.ratio == 0
        rows = torch.where(closes, ctx.attention.slot_mapping // self.ratio, flat.shape[0] - 1)
        flat.index_copy_(0, rows, pooled.to(flat.dtype))


class QSAAttention(nn.Module):
    """forward(x [T, hidden], ctx) -> [T, hidden]. A cache layer (the K/V) with FP8 scales; its
    indexer and the indexer's key window are cache layers of their own."""

    def __init__(self, config: PretrainedConfig, rotary: PartialRotary, backend: QSABackend | None = None, *,
                 quant: QuantizationConfig | None = None, prefix: str = "", block_size: int = 16,
                 cache_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        quant = quant or Unquantized()
        self.backend = backend or TorchQSABackend()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.kv_dtype = cache_dtype or torch.get_default_dtype()
        self.backend.check_supported(self.num_heads, self.num_kv_heads, torch.get_default_dtype(), self.kv_dtype)
        bias = bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, [2 * q_size, kv_size, kv_size], bias=bias,
                               method=quant.linear_method(f"{prefix}.qkv_proj"))
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias, method=quant.linear_method(f"{prefix}.o_proj"))
        self.q_norm = GroupedRMSNorm(self.head_dim, 1, config.rms_norm_eps)
        self.k_norm = GroupedRMSNorm(self.head_dim, 1, config.rms_norm_eps)
        self.rotary = rotary
        self.indexer = QSAIndexer(config, rotary, self.backend, quant=quant, prefix=f"{prefix}.indexer",
                                  block_size=block_size)
        self.block_size = block_size
        self.scale = self.head_dim**-0.5
        self.kv_cache = torch.empty(0)  # bound by the runner
        self.k_scale = self.v_scale = 1.0
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

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.rotary(ctx.positions, self.q_norm(q))
        k = self.rotary(ctx.positions, self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)))
        blocks = self.indexer(x, ctx)
        metadata = ctx.attention
        self.backend.write_kv(k, v.view(num_tokens, self.num_kv_heads, self.head_dim), self.kv_cache,
                              metadata.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.attend(q, self.kv_cache, metadata, blocks, self.indexer.ratio, self.scale, self.k_scale,
                                  self.v_scale)
        return self.o_proj(out.flatten(1) * torch.sigmoid(gate.reshape(num_tokens, -1)))

"""Qwen4Exp's PLE n-gram memory: hashed n-gram embeddings injected into the residual streams.

At a PLE layer every token looks up, for each n-gram order 2 .. ngram_size, `heads_per_ngram`
rows of one embedding table: the ids of the token and the ones before it are multiplied by
per-layer odd constants (splitmix64 of the config's seed), xor-ed, and reduced modulo a distinct
prime per head (the k-th prime from `ngram_vocab_size_base`), offset into the head's part of the
table. A token that follows an end-of-sequence id sees end-of-sequence ids in its place and
everything before it (documents packed in one request do not hash across their boundary).

The concatenated embedding gives a value and a key per stream; each stream's normalised state
gates the value (sigmoid of a signed square root of key . query / sqrt(hidden)); the gated
values, normalised, go through a causal depthwise conv dilated by ngram_size with SiLU, and
gated values plus conv output are added to the streams.

Per request the layer keeps, in its state slot, the last ngram_size - 1 token ids and the conv's
last (kernel - 1) * dilation inputs: a chunk continues exactly where the last one stopped, and
packed requests never see each other's tokens (`RequestWindows`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.kv.specs import RecurrentStateSpec, StateTensor
from tokenmill.layers.hyper_connections import stream_norm
from tokenmill.layers.linear import Linear
from tokenmill.layers.request_windows import RequestWindows
from tokenmill.layers.step_context import StepContext
from tokenmill.quantization import QuantizationConfig, Unquantized
from tokenmill.quantization.base import Shard, embedding, set_weight_loader
from tokenmill.quantization.weight_loading import output_rows_loader

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007
HASH_CONSTANTS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
"""Buffers a checkpoint stores beside the table; they follow from the config, so they are checked, not loaded."""


def _mix64(value: int) -> int:
    """splitmix64's output function of one step."""
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """One odd multiplier per n-gram position, small enough that id * multiplier fits int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (_mix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@functools.cache
def primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= start."""
    found: list[int] = []
    n = start
    while len(found) < count:
        if _is_prime(n):
            found.append(n)
        n += 1
    return tuple(found)


def _load_table_by_row_shards(weight: nn.Parameter, parts: int) -> None:
    """The table loads whole or as checkpoint shards (i, "rows"): torch.chunk's split into `parts`
    (chunks of ceil(rows / parts) rows, maybe fewer of them)."""
    rows = weight.shape[0]
    chunk = -(-rows // max(1, parts))
    sizes = [min(chunk, rows - start) for start in range(0, rows, chunk)]
    by_rows = output_rows_loader(sizes)

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        by_rows(param, tensor, shard[0] if isinstance(shard, tuple) else shard)

    set_weight_loader(weight, load, shards=[(i, "rows") for i in range(len(sizes))])


class NGramEmbedding(nn.Module):
    """Hashed n-gram ids of each token and their embeddings ([T, ple_embed_dim])."""

    def __init__(self, config: PretrainedConfig, ple_index: int) -> None:
        super().__init__()
        self.ngram_size = config.ngram_size
        self.heads_per_ngram = config.heads_per_ngram
        num_heads = (self.ngram_size - 1) * self.heads_per_ngram
        eos = config.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        sizes = primes_from(config.ngram_vocab_size_base, (ple_index + 1) * num_heads)[ple_index * num_heads:]
        offsets = [sum(sizes[:i]) for i in range(num_heads)]
        rows = -(-sum(sizes) // config.make_ngram_vocab_size_divisible_by) * config.make_ngram_vocab_size_divisible_by
        multipliers = hash_multipliers(config.vocab_size, self.ngram_size, ple_index, config.seed)
        self.register_buffer("layer_multipliers", torch.tensor(multipliers, dtype=torch.long), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.ngram_embedding = embedding(rows, config.ple_embed_dim // num_heads)
        _load_table_by_row_shards(self.ngram_embedding.weight, config.split_ngram_parts)

    def ngram_ids(self, history: torch.Tensor) -> torch.Tensor:
        """history [T, ngram_size]: each token's id, then the ids 1 .. ngram_size - 1 before it.
        Returns [T, heads] rows of the table."""
        eos = self.eos_token_id
        behind = history[:, 1:]
        # Past an end-of-sequence id (at it or between it and the token) the token sees only eos.
        behind = torch.where(torch.cummax((behind == eos).int(), dim=1).values.bool(), eos, behind)
        shifted = torch.cat([history[:, :1], behind], dim=1) * self.layer_multipliers
        ids = []
        mixed = shifted[:, 0]
        for order in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[:, order - 1])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            ids.append(torch.remainder(mixed[:, None], self.ngram_heads_vocab_sizes[heads]) + self.ngram_heads_offsets[heads])
        return torch.cat(ids, dim=1)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        return self.ngram_embedding(self.ngram_ids(history)).flatten(1)


class PLELayer(nn.Module):
    """forward(streams [T, n, hidden], input_ids [T], ctx) -> what the layer adds to the streams.
    A cache layer: a state slot per request holds its n-gram context and conv window."""

    def __init__(self, config: PretrainedConfig, ple_index: int, *, quant: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        quant = quant or Unquantized()
        self.hidden_size, self.hc_count = config.hidden_size, config.hc_count
        wide = self.hidden_size * self.hc_count
        embed_dim = config.ple_embed_dim
        self.context_len = config.ngram_size - 1
        self.dilation = config.ngram_size
        self.kernel_size = config.ple_conv_kernel_size
        self.window = (self.kernel_size - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(config, ple_index)
        self.key_proj = Linear(embed_dim, wide, bias=False, method=quant.linear_method(f"{prefix}.key_proj"))
        self.value_proj = Linear(embed_dim, self.hidden_size, bias=False, method=quant.linear_method(f"{prefix}.value_proj"))
        self.norm_key = stream_norm(self.hidden_size, self.hc_count, config.rms_norm_eps)
        self.norm_query = stream_norm(self.hidden_size, self.hc_count, config.rms_norm_eps)
        self.norm_conv = stream_norm(self.hidden_size, self.hc_count, config.rms_norm_eps)
        self.conv1d = nn.Conv1d(wide, wide, self.kernel_size, groups=wide, dilation=self.dilation, bias=False)
        self.ngram_context = torch.empty(0, dtype=torch.long)  # [slots, ngram_size - 1], bound by the runner
        self.conv_window = torch.empty(0)  # [slots, window, n * hidden]

    def cache_spec(self) -> RecurrentStateSpec:
        wide = self.hidden_size * self.hc_count
        return RecurrentStateSpec((
            StateTensor("ngram_context", (self.context_len,), torch.long),
            StateTensor("conv_window", (self.window, wide), self.conv1d.weight.dtype),
        ), writes_checkpoints=True)

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.ngram_context, self.conv_window = cache["ngram_context"], cache["conv_window"]

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        windows = RequestWindows.of(ctx)
        embedding = self.ple_embedding(self.token_history(input_ids, windows))
        key = self.norm_key(self.key_proj(embedding).unflatten(-1, (self.hc_count, self.hidden_size)))
        value = self.value_proj(embedding)
        query = self.norm_query(streams)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)
        return gated + self.short_conv(self.norm_conv(gated).flatten(1), windows).view_as(gated)

    def token_history(self, input_ids: torch.Tensor, windows: RequestWindows) -> torch.Tensor:
        """[T, ngram_size]: each token's id and the ids before it (eos before a request's first
        token); updates the slots' n-gram context."""
        n = self.context_len
        ext = windows.extend(input_ids, self.ngram_context, self.ple_embedding.eos_token_id)
        history = torch.stack([input_ids.long()] + [ext[windows.back(m, n)] for m in range(1, n + 1)], dim=1)
        windows.store(self.ngram_context, ext, n)
        return history

    def short_conv(self, x: torch.Tensor, windows: RequestWindows) -> torch.Tensor:
        """SiLU of the causal dilated depthwise conv of x [T, C], continuing each request's window."""
        ext = windows.extend(x, self.conv_window, 0.0)
        weight = self.conv1d.weight[:, 0].float()  # [C, K]; tap K - 1 is the token itself
        out = x.float() * weight[:, -1]
        for tap in range(self.kernel_size - 1):
            out = out + ext[windows.back((self.kernel_size - 1 - tap) * self.dilation, self.window)].float() * weight[:, tap]
        windows.store(self.conv_window, ext, self.window)
        return F.silu(out).to(x.dtype)

"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight, Kimi-Linear's NoPE layers) over
a paged latent cache.

Parameters carry the checkpoint's names (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), so a transformers state dict loads as is.
Per token: kv_a_proj_with_mqa gives the latent (kv_lora_rank, then RMS-normalised with eps 1e-6
as transformers does, whatever rms_norm_eps says) and the shared key part k_pe (rope_dim); both
are cached, one row of kv_lora_rank + rope_dim values (576 for the real models), in the model
dtype or FP8 E4M3 with the layer's scalar `cache_scale` (quantized on write, see mla_ref).
kv_b_proj holds per head W_UK (qk_nope_head_dim rows) then W_UV (v_head_dim rows).

Rotary embedding of the rope_dim part (`rope=`, chosen by the model's own file):
- "interleaved": frequency i rotates the pair (x[2i], x[2i+1]). DeepSeek-V2 (always) and V3
  with rope_interleave. transformers' V2 writes the pairs back in place, its V3 writes all first
  then all second elements; this layer writes the V3 layout for both, and since q and k are
  permuted alike, q_pe . k_pe (hence the attention) is the same as V2's.
- "neox": the rotate-half layout (V3 with rope_interleave false).
- None: NoPE (Kimi-Linear). q's last rope_dim columns and k_pe still enter the scores, unrotated,
  so the cache keeps the k_pe slice: the row is kv_lora_rank + rope_dim wide here too.
Rotation runs in float32 and rounds to the model dtype once (mla_rotary). YaRN: the cos/sin
scale (attention_factor) comes from transformers' rope init; with mscale_all_dim the softmax
scale is qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2, as transformers' yarn_apply_mscale
does (NoPE: no mscale).

Two ways to attend, chosen per request by `takes_absorbed_path` (the only place):
- absorbed (query_len <= ABSORBED_MAX_QUERY_LEN: decode, and verification of up to 16 drafts):
  q_nope is folded through W_UK into a kv_lora_rank-wide query beside q_pe, and one MQA kernel
  reads the latent cache directly (key = latent || k_pe, value = latent); W_UV and o_proj
  follow. Bytes-bound at small batch: each latent row is read once per query tile.
- up-projected (longer prefill chunks): the request's cached latents go through kv_b_proj to
  per-head k_nope and v, and an ordinary causal kernel attends with head sizes nope + rope and v.
In FLOPs, per (query, key, head) the absorbed form costs 2 (2 L + R) against 2 (N + R + V), and
the up-projection 2 L (N + V) per (key, head) once a step (L latent, R rope, N nope, V value):
they cross at a query run of L (N + V) / (2 L - N - V), about 170 for DeepSeek's 512 / 64 / 128 /
128. The threshold keeps the absorbed kernel to what it is tuned for (few query tokens); whether
longer chunks should take it too is measured, not assumed: benchmarks/mla_bench.py times both
paths on 64-, 256- and 2048-token chunks.
Before either, the backend's `prepare` normalises the latent, rotates q_pe (in place) and k_pe and
writes the cache (one fused kernel on the triton backend). Both paths read the step's own tokens
back from the cache, so a token attends to the same (FP8-rounded) keys whether its context
arrived in this chunk or an earlier one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import LatentAttentionSpec
from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.mla_backends import MLABackend, TorchMLABackend
from tokenmill.layers.attention.mla_ref import gather_context, rms_norm_ref
from tokenmill.layers.attention.mla_rotary import MLARotary, RopeStyle
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.step_context import StepContext
from tokenmill.quantization import QuantizationConfig, Unquantized
from tokenmill.quantization.kv_scales import latent_scale

ABSORBED_MAX_QUERY_LEN = 17
"""Longest query run (per request and step) that takes the absorbed kernel: one token plus up
to 16 draft tokens to verify. Longer runs are prefill chunks and are up-projected."""
LATENT_NORM_EPS = 1e-6


def takes_absorbed_path(query_len: int) -> bool:
    return query_len <= ABSORBED_MAX_QUERY_LEN


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> MLADims:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if kv_heads != heads:
            raise ConfigError(f"MLA expands the latent to every head: num_key_value_heads ({kv_heads}) must equal "
                              f"num_attention_heads ({heads})")
        return cls(heads, config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values per token in the latent cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_softmax_scale(config: PretrainedConfig, qk_head_dim: int, rotary: bool) -> float:
    scale = qk_head_dim**-0.5
    params = getattr(config, "rope_parameters", None) or {}
    if rotary and params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params.get("factor") or 1.0
        if factor > 1:
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def select_requests(metadata: AttentionMetadata, requests: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of some requests of a step, packed, and their query rows in the step."""
    device = metadata.seq_lens.device
    starts = [0]
    for q_len in metadata.query_lens_host:
        starts.append(starts[-1] + q_len)
    rows = torch.tensor([t for i in requests for t in range(starts[i], starts[i + 1])], dtype=torch.long, device=device)
    query_lens = [metadata.query_lens_host[i] for i in requests]
    packed = [0]
    for q_len in query_lens:
        packed.append(packed[-1] + q_len)
    index = torch.tensor(requests, dtype=torch.long, device=device)
    selected = AttentionMetadata(
        query_start_loc=torch.tensor(packed, dtype=torch.int32, device=device),
        seq_lens=metadata.seq_lens[index],
        block_tables=metadata.block_tables[index],
        slot_mapping=metadata.slot_mapping[rows],
        query_lens_host=query_lens,
        seq_lens_host=[metadata.seq_lens_host[i] for i in requests],
    )
    return selected, rows


class MLAAttention(nn.Module):
    """forward(x [T, hidden], ctx) -> [T, hidden]. A cache layer: it declares a
    LatentAttentionSpec and is bound its paged latent cache (`kv_cache`) by the runner."""

    def __init__(
        self,
        config: PretrainedConfig,
        rope: RopeStyle | None,
        backend: MLABackend | None = None,
        *,
        quant: QuantizationConfig | None = None,
        prefix: str = "",
        block_size: int = 16,
        cache_dtype: torch.dtype | None = None,
        use_triton: bool = False,
    ) -> None:
        """quant: each projection's linear method by its name under `prefix` (None: unquantized).
        cache_dtype: the latent cache's (None: the model dtype; FP8 E4M3 takes `cache_scale`).
        use_triton: tokenmill's Triton kernels for the q LoRA norm and the few-row matmuls (CUDA)."""
        super().__init__()
        self.dims = d = MLADims.from_config(config)
        quant = quant or Unquantized(use_triton)
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))

        def linear(name: str, in_features: int, out_features: int, with_bias: bool) -> Linear:
            method = quant.linear_method(f"{prefix}.{name}" if prefix else name)
            return Linear(in_features, out_features, bias=with_bias, method=method)

        if d.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, d.num_heads * d.qk_head_dim, False)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, d.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, LATENT_NORM_EPS, use_triton)
            self.q_b_proj = linear("q_b_proj", d.q_lora_rank, d.num_heads * d.qk_head_dim, False)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, d.cache_width, bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LATENT_NORM_EPS, use_triton)
        self.kv_b_proj = linear("kv_b_proj", d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), False)
        self.o_proj = linear("o_proj", d.num_heads * d.v_head_dim, hidden, bias)
        self.rotary = MLARotary(config, d.qk_rope_head_dim, rope) if rope is not None else None
        self.softmax_scale = mla_softmax_scale(config, d.qk_head_dim, rope is not None)
        self.backend = backend or TorchMLABackend()
        self.block_size = block_size
        self.cache_dtype = cache_dtype or torch.get_default_dtype()
        self.backend.check_supported(torch.get_default_dtype(), self.cache_dtype)
        self.kv_cache = torch.empty(0)  # bound by the runner
        self.cache_scale = 1.0
        self.checkpoint_kv_scales: tuple[float] | None = None
        self._absorption: tuple[torch.Tensor, torch.Tensor] | None = None  # W_UK, W_UV of a quantized kv_b_proj

    def cache_spec(self) -> LatentAttentionSpec:
        return LatentAttentionSpec(self.block_size, self.cache_dtype, self.dims.cache_width)

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

    @property
    def kv_scales(self) -> tuple[float]:
        return (self.cache_scale,)

    @kv_scales.setter
    def kv_scales(self, scales: tuple[float, ...]) -> None:
        (self.cache_scale,) = scales

    def scales_from_checkpoint(self, path: str, given: Mapping[str, float]) -> tuple[float]:
        return latent_scale(path, given)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        d = self.dims
        metadata = ctx.attention
        q, compressed = self.projections(x)
        self.backend.prepare(ctx.positions, q, compressed, self.kv_a_layernorm, self.rotary, self.kv_cache,
                             metadata.slot_mapping, self.cache_scale)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        out = self.attend(q_nope, q_pe, self.kv_cache, metadata)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, nope + rope], kv_a_proj_with_mqa's output [T, kv_lora_rank + rope]), before norm and rope."""
        d = self.dims
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], d.num_heads, d.qk_head_dim), self.kv_a_proj_with_mqa(x)

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q_nope [T, H, nope], rotated q_pe [T, H, rope], latent [T, kv_lora_rank], rotated k_pe
        [T, rope]) in plain PyTorch, writing nothing: what `prepare` computes, for inspection."""
        d = self.dims
        q, compressed = self.projections(x)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        latent, k_pe = compressed.split([d.kv_lora_rank, d.qk_rope_head_dim], -1)
        latent = rms_norm_ref(latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        if self.rotary is not None:
            q_pe, k_pe = self.rotary(positions, q_pe), self.rotary(positions, k_pe)
        return q_nope, q_pe, latent, k_pe

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """[T, H, v_head_dim] over a cache that already holds this step's latents."""
        absorbed = [takes_absorbed_path(q_len) for q_len in metadata.query_lens_host]
        if all(absorbed):
            return self.attend_absorbed(q_nope, q_pe, cache, metadata)
        if not any(absorbed):
            return self.attend_upprojected(q_nope, q_pe, cache, metadata)
        out = q_nope.new_empty(*q_nope.shape[:2], self.dims.v_head_dim)
        for flag, attend in ((True, self.attend_absorbed), (False, self.attend_upprojected)):
            selected, rows = select_requests(metadata, [i for i, a in enumerate(absorbed) if a == flag])
            out[rows] = attend(q_nope[rows], q_pe[rows], cache, selected)
        return out

    def process_weights_after_loading(self) -> None:
        """After the linear methods processed their weights: a kv_b_proj stored in another dtype
        than the model's (quantized) keeps a dequantized copy for the absorbed path."""
        dtype = self.kv_a_layernorm.weight.dtype
        weight = self.kv_b_proj.weight
        self._absorption = None
        if weight.dtype != dtype:
            self._absorption = self._split_absorption(self.kv_b_proj.dequantized_weight().to(dtype))

    def _split_absorption(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        weight = weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return weight[:, : d.qk_nope_head_dim], weight[:, d.qk_nope_head_dim :]

    def absorption_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]): views of kv_b_proj's weight,
        or of its dequantized copy when it is quantized."""
        if self._absorption is not None:
            return self._absorption
        return self._split_absorption(self.kv_b_proj.weight)

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        metadata: AttentionMetadata) -> torch.Tensor:
        w_uk, w_uv = self.absorption_weights()
        num_tokens = q_nope.shape[0]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out = q_nope.new_empty(self.dims.num_heads, num_tokens, self.dims.kv_lora_rank).transpose(0, 1)
        self.backend.absorbed(q_latent, q_pe, cache, metadata, self.softmax_scale, self.cache_scale, out)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def attend_upprojected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                           metadata: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        context = gather_context(cache, metadata, self.cache_scale, q_nope.dtype)
        kv = self.kv_b_proj(context[:, : d.kv_lora_rank]).view(-1, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
        seq_lens = metadata.seq_lens.long()
        kv_starts = torch.cumsum(seq_lens, 0) - seq_lens
        return self.backend.upprojected(
            q_nope, q_pe, kv[..., : d.qk_nope_head_dim], context[:, d.kv_lora_rank :], kv[..., d.qk_nope_head_dim :],
            metadata, kv_starts, self.softmax_scale,
        )

"""The MLA reference: plain PyTorch over the paged latent cache, on CPU or CUDA.

Slow (a loop over requests) and obviously correct; the Triton MLA kernels are tested against it.

Latent cache layout: [num_blocks, block_size, kv_lora_rank + rope_dim], one vector per token
(the normalised latent c_kv, then the rotated shared key k_pe); token slot s lives at block
s // block_size, row s % block_size. An FP8 E4M3 cache stores x / scale saturated at +-448 with
one scalar scale per layer for both parts; reads multiply the scale back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.mla_rotary import MLARotary
from tokenmill.layers.attention.torch_ref import FP8, FP8_MAX

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """A same-width integer view: index_copy_ and gathers have no FP8 kernel on every device."""
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def latent_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, int, int]:
    return (num_blocks, block_size, kv_lora_rank + rope_dim)


def quantize_latent_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32, saturated, as FP8 E4M3. The divisor is a device tensor because CUDA
    turns division by a host scalar into multiplication by its reciprocal."""
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_latent_cache_ref(
    latent: torch.Tensor,  # [T, kv_lora_rank]
    k_pe: torch.Tensor,  # [T, rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot (a padded token) is skipped
    scale: float = 1.0,
) -> None:
    keep = slot_mapping >= 0
    row = torch.cat((latent, k_pe), dim=-1)[keep]
    if cache.dtype == FP8:
        row = quantize_latent_ref(row, scale)
    else:
        row = row.to(cache.dtype)
    _as_int(cache).view(-1, cache.shape[-1]).index_copy_(0, slot_mapping[keep], _as_int(row))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' RMSNorm: the norm in float32, rounded to x's dtype, then the weight product."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def prepare_latents_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, nope + rope]: the rope part is rotated in place
    compressed: torch.Tensor,  # [T, kv_lora_rank + rope]: kv_a_proj_with_mqa's output
    norm_weight: torch.Tensor,
    norm_eps: float,
    rotary: MLARotary | None,  # None: NoPE
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """What comes before attention: normalise the latent, rotate k_pe and q_pe, cache latent || k_pe."""
    latent_dim = norm_weight.shape[0]
    rope_dim = compressed.shape[1] - latent_dim
    latent, k_pe = rms_norm_ref(compressed[:, :latent_dim], norm_weight, norm_eps), compressed[:, latent_dim:]
    if rotary is not None:
        q[..., q.shape[-1] - rope_dim :] = rotary(positions, q[..., q.shape[-1] - rope_dim :])
        k_pe = rotary(positions, k_pe)
    write_latent_cache_ref(latent, k_pe, cache, slot_mapping, scale)


def context_positions(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every request's tokens 0 .. seq_len - 1, requests one after
    another (two [sum(seq_lens)] int64 tensors). Sizes come from the host lengths: nothing is
    read back from the device."""
    device = metadata.seq_lens.device
    total = sum(metadata.seq_lens_host)
    seq_lens = metadata.seq_lens.long()
    request = torch.repeat_interleave(torch.arange(len(metadata.seq_lens_host), device=device), seq_lens, output_size=total)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    return request, torch.arange(total, device=device) - starts[request]


def gather_context(cache: torch.Tensor, metadata: AttentionMetadata, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Every request's cached latent rows, dequantized to dtype: [sum(seq_lens), kv_lora_rank + rope_dim]."""
    block_size = cache.shape[1]
    request, position = context_positions(metadata)
    blocks = metadata.block_tables.long()[request, position // block_size]
    rows = _as_int(cache).view(-1, cache.shape[-1])[blocks * block_size + position % block_size].view(cache.dtype)
    if cache.dtype == FP8:
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)


def _causal_mask(q_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Query j sits at position seq_len - q_len + j and sees keys 0 .. that position."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def absorbed_attention_ref(
    q_latent: torch.Tensor,  # [T, H, kv_lora_rank]: q_nope folded through W_UK
    q_pe: torch.Tensor,  # [T, H, rope_dim], rotated
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    softmax_scale: float,
    cache_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, kv_lora_rank] float32
    """MQA of the absorbed queries over the latent cache: K = latent || k_pe, V = latent."""
    latent_dim = q_latent.shape[-1]
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    keys = gather_context(cache, metadata, cache_scale, torch.float32)
    q = torch.cat((q_latent, q_pe), dim=-1).float()
    q_start = k_start = 0
    for q_len, seq_len in zip(metadata.query_lens_host, metadata.seq_lens_host):
        k = keys[k_start : k_start + seq_len]
        scores = torch.einsum("thd,sd->hts", q[q_start : q_start + q_len], k) * softmax_scale
        scores = scores.masked_fill(~_causal_mask(q_len, seq_len, q.device), float("-inf"))
        out[q_start : q_start + q_len] = torch.einsum("hts,sd->thd", scores.softmax(-1), k[:, :latent_dim])
        q_start += q_len
        k_start += seq_len
    return out


def upprojected_attention_ref(
    q: torch.Tensor,  # [T, H, nope + rope]: q_nope || rotated q_pe
    k_nope: torch.Tensor,  # [S, H, nope]: the up-projected context, requests one after another
    k_pe: torch.Tensor,  # [S, rope], shared by every head
    v: torch.Tensor,  # [S, H, v_head_dim]
    metadata: AttentionMetadata,
    softmax_scale: float,
) -> torch.Tensor:  # [T, H, v_head_dim] float32
    """Ordinary causal attention with per-head keys (nope || k_pe) and values, one request at a time."""
    num_heads = q.shape[1]
    keys = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1).float()
    out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=torch.float32, device=q.device)
    q_start = k_start = 0
    for q_len, seq_len in zip(metadata.query_lens_host, metadata.seq_lens_host):
        out[q_start : q_start + q_len] = F.scaled_dot_product_attention(
            q[q_start : q_start + q_len].float().transpose(0, 1),
            keys[k_start : k_start + seq_len].transpose(0, 1),
            v[k_start : k_start + seq_len].float().transpose(0, 1),
            attn_mask=_causal_mask(q_len, seq_len, q.device),
            scale=softmax_scale,
        ).transpose(0, 1)
        q_start += q_len
        k_start += seq_len
    return out

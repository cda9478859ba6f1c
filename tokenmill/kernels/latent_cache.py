"""Writing a step's MLA latents into the paged latent cache, FP8 quantized on write; optionally
fused with what comes before the write on the layer's path (`prepare_latents`): the latent's
RMSNorm and the rotation of k_pe and of every head's q_pe (in place), so a decode step pays one
launch for all of it.

Cache layout and FP8 semantics: tokenmill.layers.attention.mla_ref, whose write_latent_cache_ref
and prepare_latents_ref are the references. One program per token; a negative slot (a padded
token of a CUDA-graph batch) writes nothing to the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import FP8_DTYPE, interpreting, next_pow2
from tokenmill.kernels.kv_cache import cache_value

NO_ROTATION, INTERLEAVED, HALVES = 0, 1, 2


@triton.jit
def _pair_offsets(offs_h, HALF: tl.constexpr, ROTATE: tl.constexpr):
    """Where each rotation pair's first and second element sit in a rope_dim-wide vector."""
    if ROTATE == 1:
        return 2 * offs_h, 2 * offs_h + 1
    return offs_h, offs_h + HALF


@triton.jit
def _write_latent_kernel(
    latent_ptr, pe_ptr, cache_ptr, slot_ptr, scale,
    q_ptr, pos_ptr, inv_freq_ptr, norm_w_ptr, eps, attention_factor, num_heads,
    stride_lt, stride_pt, stride_qt, stride_qh, stride_cb, stride_ct,
    LATENT: tl.constexpr, HALF: tl.constexpr, LATENT_P: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr,
    Q_PE: tl.constexpr, NORM: tl.constexpr, ROTATE: tl.constexpr,
    PAGE: tl.constexpr, QUANT: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    dtype = latent_ptr.dtype.element_ty
    offs_h = tl.arange(0, HALF_P)
    h_ok = offs_h < HALF
    first, second = _pair_offsets(offs_h, HALF, ROTATE)
    k1 = tl.load(pe_ptr + tok * stride_pt + first, mask=h_ok, other=0.0).to(tl.float32)
    k2 = tl.load(pe_ptr + tok * stride_pt + second, mask=h_ok, other=0.0).to(tl.float32)
    if ROTATE != 0:
        angle = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + offs_h, mask=h_ok, other=0.0)
        c = tl.cos(angle) * attention_factor
        s = tl.sin(angle) * attention_factor
        heads = tl.arange(0, HEADS_P)[:, None]
        q_ok = (heads < num_heads) & h_ok[None, :]
        q_row = q_ptr + tok.to(tl.int64) * stride_qt + heads * stride_qh + Q_PE
        q1 = tl.load(q_row + first[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + second[None, :], mask=q_ok, other=0.0).to(tl.float32)
        tl.store(q_row + offs_h[None, :], (q1 * c[None, :] - q2 * s[None, :]).to(dtype), mask=q_ok)
        tl.store(q_row + HALF + offs_h[None, :], (q2 * c[None, :] + q1 * s[None, :]).to(dtype), mask=q_ok)
        k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s
    if slot < 0:
        return
    offs_l = tl.arange(0, LATENT_P)
    l_ok = offs_l < LATENT
    latent = tl.load(latent_ptr + tok * stride_lt + offs_l, mask=l_ok, other=0.0)
    if NORM:
        # As RMSNorm rounds: the norm in float32, rounded to the model dtype, then the weight product.
        h = latent.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, 0) / LATENT + eps)
        h = (h * rstd).to(dtype).to(tl.float32)
        latent = (tl.load(norm_w_ptr + offs_l, mask=l_ok, other=0.0).to(tl.float32) * h).to(dtype)
    row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    out_ty = cache_ptr.dtype.element_ty
    tl.store(row + offs_l, cache_value(latent, scale, out_ty, QUANT, EMULATE_ROUNDING), mask=l_ok)
    tl.store(row + LATENT + offs_h, cache_value(k1.to(dtype), scale, out_ty, QUANT, EMULATE_ROUNDING), mask=h_ok)
    tl.store(row + LATENT + HALF + offs_h, cache_value(k2.to(dtype), scale, out_ty, QUANT, EMULATE_ROUNDING), mask=h_ok)


def _launch(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
            q: torch.Tensor | None = None, positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0, attention_factor: float = 1.0,
            rotate: int = NO_ROTATION) -> None:
    num_tokens, latent_dim = latent.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    if k_pe.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"{num_tokens} latents, {k_pe.shape[0]} k_pe rows and {slot_mapping.shape[0]} slots must agree")
    if cache.shape[2] != latent_dim + rope_dim or rope_dim % 2:
        raise ValueError(f"a latent cache row holds {cache.shape[2]} values, not {latent_dim} + {rope_dim} (even)")
    if latent.stride(1) != 1 or k_pe.stride(1) != 1 or cache.stride(2) != 1 or (q is not None and q.stride(2) != 1):
        raise ValueError("the latent cache write needs a unit stride along the last dimension")
    quant = cache.dtype == FP8_DTYPE
    q_arg = q if q is not None else latent
    _write_latent_kernel[(num_tokens,)](
        latent, k_pe, cache, slot_mapping, scale,
        q_arg, positions if positions is not None else slot_mapping, inv_freq if inv_freq is not None else latent,
        norm_weight if norm_weight is not None else latent, eps, attention_factor, q.shape[1] if q is not None else 0,
        latent.stride(0), k_pe.stride(0), q_arg.stride(0), q_arg.stride(1) if q is not None else 0,
        cache.stride(0), cache.stride(1),
        LATENT=latent_dim, HALF=rope_dim // 2, LATENT_P=next_pow2(latent_dim), HALF_P=next_pow2(rope_dim // 2),
        HEADS_P=next_pow2(q.shape[1]) if q is not None else 1, Q_PE=q.shape[2] - rope_dim if q is not None else 0,
        NORM=norm_weight is not None, ROTATE=rotate,
        PAGE=cache.shape[1], QUANT=quant, EMULATE_ROUNDING=quant and interpreting(),
        num_warps=4 if latent_dim >= 256 else 1,
    )


def write_latent_cache(
    latent: torch.Tensor,  # [T, kv_lora_rank], any row stride, unit column stride
    k_pe: torch.Tensor,  # [T, rope_dim], likewise
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [T] int64
    scale: float = 1.0,
) -> None:
    _launch(latent, k_pe, cache, slot_mapping, scale)


def prepare_latents(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, nope + rope_dim]: its last rope_dim columns are rotated in place
    compressed: torch.Tensor,  # [T, kv_lora_rank + rope_dim]: kv_a_proj_with_mqa's output
    norm_weight: torch.Tensor,  # [kv_lora_rank]
    eps: float,
    inv_freq: torch.Tensor | None,  # [rope_dim / 2] float32; None: NoPE (nothing rotated)
    attention_factor: float,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """Normalise the latent, rotate k_pe and q_pe, and write latent || k_pe to the cache."""
    latent_dim = norm_weight.shape[0]
    rotate = NO_ROTATION if inv_freq is None else (INTERLEAVED if interleaved else HALVES)
    _launch(compressed[:, :latent_dim], compressed[:, latent_dim:], cache, slot_mapping, scale, q=q, positions=positions,
            inv_freq=inv_freq, norm_weight=norm_weight, eps=eps, attention_factor=attention_factor, rotate=rotate)

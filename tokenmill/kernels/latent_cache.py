"""Writing a step's MLA latents into the paged latent cache, FP8 quantized on write.

Cache layout and FP8 semantics: tokenmill.layers.attention.mla_ref (the reference,
write_latent_cache_ref). One program per token writes its kv_lora_rank latent values then its
rope_dim rotated k_pe values into its slot's row; a negative slot (a padded token of a
CUDA-graph batch) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import FP8_DTYPE, interpreting, next_pow2
from tokenmill.kernels.kv_cache import cache_value


@triton.jit
def _write_latent_kernel(
    latent_ptr, pe_ptr, cache_ptr, slot_ptr, scale,
    stride_lt, stride_pt, stride_cb, stride_ct,
    LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_P: tl.constexpr, ROPE_P: tl.constexpr,
    PAGE: tl.constexpr, QUANT: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    out_ty = cache_ptr.dtype.element_ty
    offs_l = tl.arange(0, LATENT_P)
    mask_l = offs_l < LATENT
    latent = tl.load(latent_ptr + tok * stride_lt + offs_l, mask=mask_l)
    tl.store(row + offs_l, cache_value(latent, scale, out_ty, QUANT, EMULATE_ROUNDING), mask=mask_l)
    offs_r = tl.arange(0, ROPE_P)
    mask_r = offs_r < ROPE
    pe = tl.load(pe_ptr + tok * stride_pt + offs_r, mask=mask_r)
    tl.store(row + LATENT + offs_r, cache_value(pe, scale, out_ty, QUANT, EMULATE_ROUNDING), mask=mask_r)


def write_latent_cache(
    latent: torch.Tensor,  # [T, kv_lora_rank], any row stride, unit column stride
    k_pe: torch.Tensor,  # [T, rope_dim], likewise
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    slot_mapping: torch.Tensor,  # [T] int64
    scale: float = 1.0,
) -> None:
    num_tokens, latent_dim = latent.shape
    rope_dim = k_pe.shape[1]
    if num_tokens == 0:
        return
    if k_pe.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"{num_tokens} latents, {k_pe.shape[0]} k_pe rows and {slot_mapping.shape[0]} slots must agree")
    if cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(f"a latent cache row holds {cache.shape[2]} values, not {latent_dim} + {rope_dim}")
    if latent.stride(1) != 1 or k_pe.stride(1) != 1 or cache.stride(2) != 1:
        raise ValueError("write_latent_cache needs a unit stride along the last dimension")
    quant = cache.dtype == FP8_DTYPE
    _write_latent_kernel[(num_tokens,)](
        latent, k_pe, cache, slot_mapping, scale,
        latent.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        LATENT=latent_dim, ROPE=rope_dim, LATENT_P=next_pow2(latent_dim), ROPE_P=next_pow2(rope_dim),
        PAGE=cache.shape[1], QUANT=quant, EMULATE_ROUNDING=quant and interpreting(),
        num_warps=4 if latent_dim >= 256 else 1,
    )

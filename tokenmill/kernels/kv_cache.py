"""Writing a step's keys and values into the paged KV cache (reshape-and-cache).

Cache layout (the backend's `kv_cache_shape`): kv_cache[0] holds keys and kv_cache[1] values,
each [num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives at block
s // block_size, row s % block_size. A negative slot (a padded token of a CUDA-graph batch) is
skipped. An FP8 E4M3 cache stores x / scale, saturated at +-448; readers multiply back by scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import (
    E4M3_MAX,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    interpreting,
    next_pow2,
    round_to_e4m3_grid,
)


def quantize_fp8_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float32, saturated, as torch_ref.write_kv quantizes. The divisor is a device
    tensor because CUDA turns division by a host scalar into multiplication by its reciprocal."""
    divisor = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The reference: the same as the torch backend's write_kv, plus FP8 scaling; skips slot < 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = key.shape[1:]
    for plane, x, scale in ((0, key, k_scale), (1, value, v_scale)):
        x = x[keep]
        dst = kv_cache[plane].view(-1, num_kv_heads, head_dim)
        if kv_cache.dtype == FP8_DTYPE:  # index_copy_ has no float8 kernel: copy the bytes
            dst.view(torch.uint8).index_copy_(0, slots, quantize_fp8_ref(x, scale).view(torch.uint8))
        else:
            dst.index_copy_(0, slots, x.to(kv_cache.dtype))


@triton.jit
def cache_value(x, scale, out_ty: tl.constexpr, QUANT: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """x as the cache stores it: for FP8, x / scale saturated at +-448."""
    if QUANT:
        # IEEE division (a plain / may be approximate on the GPU), rounding as the reference does.
        x = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -E4M3_MAX), E4M3_MAX)
        if EMULATE_ROUNDING:
            x = round_to_e4m3_grid(x)
    return x.to(out_ty)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_plane, stride_block, stride_tok, stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, DIM_P: tl.constexpr,
    PAGE: tl.constexpr, QUANT: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = (slot // PAGE) * stride_block + (slot % PAGE) * stride_tok + heads * stride_head + dims
    k = tl.load(key_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
    out_ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, cache_value(k, k_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=mask)
    tl.store(cache_ptr + stride_plane + dst, cache_value(v, v_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], any row/head strides, unit dim stride
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if slot_mapping.shape[0] != num_tokens or value.shape != key.shape:
        raise ValueError(f"{num_tokens} keys, {value.shape[0]} values and {slot_mapping.shape[0]} slots must agree")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("write_kv_cache needs a unit stride along head_dim")
    quant = kv_cache.dtype == FP8_DTYPE
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=next_pow2(num_kv_heads), DIM_P=next_pow2(head_dim),
        PAGE=kv_cache.shape[2], QUANT=quant, EMULATE_ROUNDING=quant and interpreting(),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )

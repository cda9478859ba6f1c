"""Rotary position embedding, rotate-half layout, applied in place to q and k.

cos/sin caches are [max_positions, rot] float32 with rot = head_dim (both halves equal, as
tokenmill.layers.rotary builds them) or head_dim / 2; only the first head_dim / 2 columns are
read. The arithmetic rounds as the PyTorch module does in the model dtype: cos and sin are cast
to it, and each product and sum is rounded to it. That needs Triton's FP fusion off: with it on,
one product of each pair entered a bf16 fused multiply-add unrounded, and which one depended on
the instruction schedule (two kernels with the same arithmetic disagreed by an ulp on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import FP8_DTYPE, interpreting, next_pow2
from tokenmill.kernels.kv_cache import cache_value

# Fusion off: every product is rounded to the model dtype before the sum (see the docstring).
LAUNCH = dict(num_warps=4, enable_fp_fusion=False)


def apply_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    c = cos[positions, :half].unsqueeze(1).to(q.dtype)
    s = sin[positions, :half].unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rotate(q), rotate(k)


@triton.jit
def _rotated(x1, x2, c, s):
    """The two rotated halves in x's dtype, every product rounded to it before the sum, as the
    unfused PyTorch ops in the model dtype do."""
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = (a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)
    o2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _head_halves(x_ptr, stride_h, num_heads, HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Pointers to the first halves of a token's heads, their mask, and both halves loaded."""
    heads = tl.arange(0, HEADS_P)[:, None]
    cols = tl.arange(0, HALF_P)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    p1 = x_ptr + heads * stride_h + cols
    return p1, mask, tl.load(p1, mask=mask, other=0.0), tl.load(p1 + HALF, mask=mask, other=0.0)


@triton.jit
def _rotate_heads(x_ptr, stride_h, c, s, num_heads, HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    p1, mask, x1, x2 = _head_halves(x_ptr, stride_h, num_heads, HALF, HEADS_P, HALF_P)
    o1, o2 = _rotated(x1, x2, c, s)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, QH_P: tl.constexpr, KH_P: tl.constexpr,
):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    cols = tl.arange(0, HALF_P)[None, :]
    cmask = cols < HALF
    c = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0)
    s = tl.load(sin_ptr + pos * stride_sin + cols, mask=cmask, other=0.0)
    dtype = q_ptr.dtype.element_ty
    c = c.to(dtype).to(tl.float32)
    s = s.to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, c, s, num_q_heads, HALF, QH_P, HALF_P)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, c, s, num_k_heads, HALF, KH_P, HALF_P)


def apply_rotary_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], unit stride along D; rotated in place
    k: torch.Tensor,  # [T, Hkv, D], same dtype
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("apply_rotary_ needs a unit stride along the last dimension")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            num_q_heads, k.shape[1],
            HALF=half, HALF_P=next_pow2(half), QH_P=next_pow2(num_q_heads), KH_P=next_pow2(k.shape[1]),
            **LAUNCH,
        )
    return q, k


@triton.jit
def _rotary_cache_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_plane, stride_block, stride_tok, stride_head,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, QH_P: tl.constexpr, KH_P: tl.constexpr,
    PAGE: tl.constexpr, QUANT: tl.constexpr, EMULATE_ROUNDING: tl.constexpr,
):
    # Every load that does not wait for the position is issued before cos and sin: a decode
    # step runs this once per layer at batch 1, where its latency is the whole cost.
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    slot = tl.load(slot_ptr + tok)
    q1_ptr, q_mask, q1, q2 = _head_halves(q_ptr + tok * stride_qt, stride_qh, num_q_heads, HALF, QH_P, HALF_P)
    _, kv_mask, k1, k2 = _head_halves(k_ptr + tok * stride_kt, stride_kh, num_kv_heads, HALF, KH_P, HALF_P)
    _, _, v1, v2 = _head_halves(v_ptr + tok * stride_vt, stride_vh, num_kv_heads, HALF, KH_P, HALF_P)
    cols = tl.arange(0, HALF_P)[None, :]
    cmask = cols < HALF
    dtype = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sin + cols, mask=cmask, other=0.0).to(dtype).to(tl.float32)
    q1, q2 = _rotated(q1, q2, c, s)
    tl.store(q1_ptr, q1, mask=q_mask)
    tl.store(q1_ptr + HALF, q2, mask=q_mask)
    if slot >= 0:
        k1, k2 = _rotated(k1, k2, c, s)
        heads = tl.arange(0, KH_P)[:, None]
        out_ty = cache_ptr.dtype.element_ty
        dst = cache_ptr + (slot // PAGE) * stride_block + (slot % PAGE) * stride_tok + heads * stride_head + cols
        tl.store(dst, cache_value(k1, k_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=kv_mask)
        tl.store(dst + HALF, cache_value(k2, k_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=kv_mask)
        tl.store(dst + stride_plane, cache_value(v1, v_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=kv_mask)
        tl.store(dst + stride_plane + HALF, cache_value(v2, v_scale, out_ty, QUANT, EMULATE_ROUNDING), mask=kv_mask)


def rotate_and_cache_(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], left as it is: its rotation goes to the cache only
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], model dtype or FP8 E4M3
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot writes nothing
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """apply_rotary_ then write_kv_cache in one launch: what a decode step pays once per layer."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("rotate_and_cache_ needs a unit stride along head_dim")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if num_tokens:
        quant = kv_cache.dtype == FP8_DTYPE
        _rotary_cache_kernel[(num_tokens,)](
            positions, q, k, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            num_q_heads, k.shape[1],
            HALF=head_dim // 2, HALF_P=next_pow2(head_dim // 2), QH_P=next_pow2(num_q_heads), KH_P=next_pow2(k.shape[1]),
            PAGE=kv_cache.shape[2], QUANT=quant, EMULATE_ROUNDING=quant and interpreting(),
            **LAUNCH,
        )
    return q

"""MLA prefill over the up-projected context: causal varlen flash attention whose keys are
per-head k_nope || a k_pe shared by every head, and whose values have their own width
(192 and 128 for DeepSeek-V2/V3). Reference: tokenmill.layers.attention.mla_ref.upprojected_attention_ref.

Request i's queries are rows query_start_loc[i] .. query_start_loc[i+1] - 1 (its newest tokens,
at positions seq_len - q_len ..); its context (all seq_len tokens, the new ones included) is
rows kv_starts[i] .. kv_starts[i] + seq_len - 1 of k_nope / k_pe / v, requests one after another.
A program owns BLOCK_M query tokens of one request for one head; query tiles are numbered as
in paged_attention.py, so the launch needs host-side sizes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import dot_width, interpreting, mm, next_pow2
from tokenmill.kernels.paged_attention import LOG2E, _online_softmax_step, _request_tile


@triton.jit
def _context_tiles(
    acc, m_i, l_i, q_nope, q_pe, kn_base, kp_base, v_base, q_pos, kv_end, t_lo, t_hi,
    stride_knt, stride_kpt, stride_vt, qk_scale,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr,
    NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, VDIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Online softmax over context tiles t_lo .. t_hi - 1; without CAUSAL_MASK every key of
    these tiles is visible to every row."""
    offs_kn = tl.arange(0, NOPE_P)
    offs_kp = tl.arange(0, ROPE_P)
    offs_v = tl.arange(0, VDIM_P)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        rows = offs_n.to(tl.int64)[:, None]  # a long context's row offsets pass 2**31 elements
        k_nope = tl.load(kn_base + rows * stride_knt + offs_kn[None, :],
                         mask=n_ok[:, None] & (offs_kn[None, :] < NOPE), other=0.0)
        k_pe = tl.load(kp_base + rows * stride_kpt + offs_kp[None, :],
                       mask=n_ok[:, None] & (offs_kp[None, :] < ROPE), other=0.0)
        v = tl.load(v_base + rows * stride_vt + offs_v[None, :],
                    mask=n_ok[:, None] & (offs_v[None, :] < VDIM), other=0.0)
        s = mm(q_nope, tl.trans(k_nope.to(q_nope.dtype)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, IEEE)
        s = mm(q_pe, tl.trans(k_pe.to(q_pe.dtype)), s, UPCAST, IEEE)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s * qk_scale, v.to(q_nope.dtype), visible, CAUSAL_MASK,
                                             UPCAST, IEEE)
    return acc, m_i, l_i


@triton.jit
def _mla_prefill_kernel(
    out_ptr, q_nope_ptr, q_pe_ptr, k_nope_ptr, k_pe_ptr, v_ptr,
    qsl_ptr, kv_starts_ptr, seq_lens_ptr, num_requests, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr,
    NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, VDIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest causal tiles first
    head = tl.program_id(1)
    req, q_start, q_len, q_tile_start = _request_tile(qsl_ptr, num_requests, tile, BLOCK_M)
    if q_tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len
    kv_row = tl.load(kv_starts_ptr + req).to(tl.int64)

    tok = q_tile_start + tl.arange(0, BLOCK_M)
    row_ok = tok < q_len
    q_rows = (q_start + tok).to(tl.int64)[:, None]
    offs_n = tl.arange(0, NOPE_P)
    offs_r = tl.arange(0, ROPE_P)
    offs_v = tl.arange(0, VDIM_P)
    q_nope = tl.load(q_nope_ptr + q_rows * stride_qnt + head * stride_qnh + offs_n[None, :],
                     mask=row_ok[:, None] & (offs_n[None, :] < NOPE), other=0.0)
    q_pe = tl.load(q_pe_ptr + q_rows * stride_qpt + head * stride_qph + offs_r[None, :],
                   mask=row_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)

    kv_end = ctx_start + tl.minimum(q_tile_start + BLOCK_M, q_len)
    full_tiles = (ctx_start + q_tile_start + 1) // BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VDIM_P], tl.float32)
    kn_base = k_nope_ptr + kv_row * stride_knt + head * stride_knh
    kp_base = k_pe_ptr + kv_row * stride_kpt
    v_base = v_ptr + kv_row * stride_vt + head * stride_vh
    q_pos = ctx_start + tok
    acc, m_i, l_i = _context_tiles(
        acc, m_i, l_i, q_nope, q_pe, kn_base, kp_base, v_base, q_pos, kv_end, 0, full_tiles,
        stride_knt, stride_kpt, stride_vt, qk_scale, NOPE, ROPE, VDIM, NOPE_P, ROPE_P, VDIM_P,
        BLOCK_M, BLOCK_N, False, UPCAST, IEEE,
    )
    acc, m_i, l_i = _context_tiles(
        acc, m_i, l_i, q_nope, q_pe, kn_base, kp_base, v_base, q_pos, kv_end, full_tiles, tl.cdiv(kv_end, BLOCK_N),
        stride_knt, stride_kpt, stride_vt, qk_scale, NOPE, ROPE, VDIM, NOPE_P, ROPE_P, VDIM_P,
        BLOCK_M, BLOCK_N, True, UPCAST, IEEE,
    )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows * stride_ot + head * stride_oh + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_v[None, :] < VDIM))


def upprojected_attention(
    q_nope: torch.Tensor,  # [T, H, nope], unit stride along the last dim (views are fine)
    q_pe: torch.Tensor,  # [T, H, rope], rotated
    k_nope: torch.Tensor,  # [S, H, nope]: the up-projected context of every request
    k_pe: torch.Tensor,  # [S, rope], shared by every head
    v: torch.Tensor,  # [S, H, v_head_dim]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    kv_starts: torch.Tensor,  # [B] int32 or int64: each request's first context row
    seq_lens: torch.Tensor,  # [B] int32
    softmax_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # [T, H, v_head_dim] in q's dtype
    """block_m / block_n / num_warps: the tile (None: chosen here)."""
    num_tokens, num_heads, nope = q_nope.shape
    rope, vdim = q_pe.shape[2], v.shape[2]
    out = torch.empty(num_tokens, num_heads, vdim, dtype=q_nope.dtype, device=q_nope.device)
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    if any(t.stride(-1) != 1 for t in (q_nope, q_pe, k_nope, k_pe, v)):
        raise ValueError("upprojected_attention needs a unit stride along the last dimension")
    on_gpu = q_nope.device.type == "cuda" and not interpreting()
    block_m = block_m or (64 if on_gpu else 16)
    block_n = block_n or (64 if on_gpu else 8)
    _mla_prefill_kernel[(num_tokens // block_m + num_requests, num_heads)](
        out, q_nope, q_pe, k_nope, k_pe, v,
        query_start_loc, kv_starts, seq_lens, num_requests, softmax_scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, VDIM=vdim, NOPE_P=dot_width(nope), ROPE_P=dot_width(rope), VDIM_P=next_pow2(vdim),
        BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=interpreting() and q_nope.dtype == torch.bfloat16, IEEE=q_nope.dtype == torch.float32,
        num_warps=num_warps or (8 if on_gpu else 4), num_stages=2 if on_gpu else 1,
    )
    return out

"""Recurrent gated delta rule over the slot pool: decode (one token per request) and speculative
verification (1 + gamma), token by token as gated_delta_ref.gated_delta_rule_ref.

One program per (request, value head, value-column tile) holds its [Dk, BV] state tile in
float32 registers: it reads the tile from the request's slot once (unless the request starts
fresh), steps through the request's tokens, stores the tile after each checkpointed token and
once at the end. The state moves through memory once each way, which is the whole cost at
decode. Nothing is read on the host and nothing allocated depends on data: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import and_flag, interpreting, next_pow2, sm_count


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, cu_seqlens_ptr, has_initial_ptr,
    checkpoint_ptr, scale,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, NORM: tl.constexpr, HAS_CHECKPOINTS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    dk = tl.arange(0, DK_P)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = dk < DK
    v_ok = dv < DV
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    slot = tl.load(slots_ptr + req).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + req) != 0
    s = tl.load(state_ptr + slot * stride_ss + tile, mask=and_flag(tile_ok, has_initial), other=0.0).to(tl.float32)

    # int64 bounds make the token index int64 (a long batch's row offsets pass 2**31 elements)
    for row in range(tl.load(cu_seqlens_ptr + req).to(tl.int64), tl.load(cu_seqlens_ptr + req + 1).to(tl.int64)):
        q = tl.load(q_ptr + row * stride_qt + key_head * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_qt + key_head * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + row * stride_vt + head * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_bt + head).to(tl.float32)
        if PER_CHANNEL:
            g = tl.load(g_ptr + row * stride_gt + head * stride_gh + dk, mask=k_ok, other=0.0)
            s = s * tl.exp(g)[:, None]
        else:
            s = s * tl.exp(tl.load(g_ptr + row * stride_gt + head))
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=v_ok)
        if HAS_CHECKPOINTS:
            checkpoint = tl.load(checkpoint_ptr + row).to(tl.int64)
            tl.store(state_ptr + checkpoint * stride_ss + tile, s.to(state_ptr.dtype.element_ty),
                     mask=and_flag(tile_ok, checkpoint >= 0))
    tl.store(state_ptr + slot * stride_ss + tile, s.to(state_ptr.dtype.element_ty), mask=tile_ok)


MAX_BLOCK_V = 64


def recurrent_warps(block_v: int, state_bytes: int) -> int:
    """Warps per program, the fastest of a sweep on an H200 at batch 32 and 256 (benchmarks/RESULTS.md):
    few warps, each with more of the tile's loads in flight, beat more warps with fewer; a bf16
    state tile takes half the registers of a float32 one."""
    warps = 4 if block_v <= 64 else 8
    return warps // 2 if state_bytes == 2 else warps


def recurrent_block_v(num_requests: int, value_heads: int, value_dim: int, device: torch.device) -> int:
    """Value columns per program: the widest tile (fewest redundant q/k reads) that still gives
    the grid two programs per multiprocessor; narrow tiles on CPU so tiny tests cross tiles."""
    if device.type != "cuda" or interpreting():
        return min(8, next_pow2(value_dim))
    block_v = min(MAX_BLOCK_V, next_pow2(value_dim))
    while block_v > 16 and num_requests * value_heads * triton.cdiv(value_dim, block_v) < 2 * sm_count(device):
        block_v //= 2
    return block_v


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True, checkpoint_slots: torch.Tensor | None = None,
    block_v: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """As gated_delta.gated_delta_rule, whose kernel_inputs prepares the arguments (unit-stride
    rows, k strided as q, float32 g, a contiguous pool)."""
    num_requests = slots.shape[0]
    key_heads, key_dim = q.shape[1:]
    value_heads, value_dim = v.shape[1:]
    out = torch.empty_like(v)
    if num_requests == 0:
        return out
    block_v = block_v or recurrent_block_v(num_requests, value_heads, value_dim, q.device)
    has_checkpoints = checkpoint_slots is not None
    on_gpu = q.device.type == "cuda" and not interpreting()
    _recurrent_kernel[(num_requests, value_heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, out, state, slots, cu_seqlens, has_initial_state.view(torch.int8),
        checkpoint_slots if has_checkpoints else slots, scale,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1) if g.dim() == 3 else 0,
        beta.stride(0), out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        GROUP=value_heads // key_heads, DK=key_dim, DV=value_dim, DK_P=next_pow2(key_dim), BV=block_v,
        PER_CHANNEL=g.dim() == 3, NORM=use_qk_l2norm, HAS_CHECKPOINTS=has_checkpoints,
        num_warps=num_warps or (recurrent_warps(block_v, state.element_size()) if on_gpu else 1), num_stages=1,
    )
    return out

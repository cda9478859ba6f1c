"""The gated delta rule in plain PyTorch (float32 math, any device): the recurrent form, exact per
token, and the chunked form the Triton prefill kernels mirror. No triton import here.

A batch is packed: request r owns tokens cu_seqlens[r] .. cu_seqlens[r+1] - 1 and pool slot
slots[r] of `state` [num_slots, Hv, Dk, Dv]. Per value head h (key head h // (Hv // Hk)), per token:
    S = S * exp(g_t)            (g: one log-decay per head, or one per key channel for KDA)
    delta = beta_t * (v_t - k_t^T S)
    S = S + k_t delta^T
    o_t = (scale * q_t)^T S     (q, k first L2-normalised when use_qk_l2norm)
A request starts from state[slots[r]] when has_initial_state[r], else from zeros (the slot is
not read); its final state is stored back there, rounded to the pool's dtype. checkpoint_slots[t]
>= 0 also stores the state after token t into that slot. Slots of one call are distinct: no
request slot is another's, nor a checkpoint's (rows sharing one, such as a CUDA graph's padding
rows on its scratch slot, leave garbage there and in their own outputs only). Slots and
checkpoint slots may be int32 or int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

L2NORM_EPS = 1e-6
CHUNK = 64


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """As transformers' (and fla's) l2norm: x / sqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def check_gated_delta_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    checkpoint_slots: torch.Tensor | None,
) -> None:
    num_tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != num_tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads are not a multiple of {key_heads} key heads")
    if g.shape not in ((num_tokens, value_heads), (num_tokens, value_heads, key_dim)):
        raise ValueError(f"g must be [T, Hv] or [T, Hv, Dk], got {tuple(g.shape)}")
    if beta.shape != (num_tokens, value_heads):
        raise ValueError(f"beta must be [T, Hv], got {tuple(beta.shape)}")
    if state.shape[1:] != (value_heads, key_dim, value_dim):
        raise ValueError(f"state must be [slots, {value_heads}, {key_dim}, {value_dim}], got {tuple(state.shape)}")
    if state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state must be float32 or bfloat16, got {state.dtype}")
    num_requests = slots.shape[0]
    if cu_seqlens.shape != (num_requests + 1,) or has_initial_state.shape != (num_requests,):
        raise ValueError("cu_seqlens must be [R + 1] and has_initial_state [R] for R = len(slots)")
    if checkpoint_slots is not None and checkpoint_slots.shape != (num_tokens,):
        raise ValueError(f"checkpoint_slots must be [T], got {tuple(checkpoint_slots.shape)}")


def _prepared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """float32 q (normalised, scaled) and k (normalised) per value head, v, g, beta."""
    group = v.shape[1] // q.shape[1]
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = (qf * scale).repeat_interleave(group, dim=1)
    kf = kf.repeat_interleave(group, dim=1)
    return qf, kf, v.float(), g.float(), beta.float()


def _initial(state: torch.Tensor, slot: int, has_initial: bool) -> torch.Tensor:
    return state[slot].float() if has_initial else state.new_zeros(state.shape[1:], dtype=torch.float32)


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True, checkpoint_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recurrent form, one token at a time; returns o [T, Hv, Dv] in v's dtype."""
    check_gated_delta_args(q, k, v, g, beta, state, slots, cu_seqlens, has_initial_state, checkpoint_slots)
    qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, scale, use_qk_l2norm)
    per_channel = g.dim() == 3
    out = torch.empty_like(vf)
    starts = cu_seqlens.tolist()
    checkpoints = checkpoint_slots.tolist() if checkpoint_slots is not None else None
    for r, (slot, has_initial) in enumerate(zip(slots.tolist(), has_initial_state.tolist())):
        s = _initial(state, slot, has_initial)  # [Hv, Dk, Dv]
        for t in range(starts[r], starts[r + 1]):
            decay = gf[t].exp()
            s = s * (decay[:, :, None] if per_channel else decay[:, None, None])
            kv_mem = torch.einsum("hkv,hk->hv", s, kf[t])
            delta = (vf[t] - kv_mem) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
            if checkpoints is not None and checkpoints[t] >= 0:
                state[checkpoints[t]] = s.to(state.dtype)
        state[slot] = s.to(state.dtype)
    return out.to(v.dtype)


@dataclass(frozen=True)
class ChunkPlan:
    """Chunks of at most `chunk_size` tokens, none crossing a request boundary, and each
    checkpointed token the last of its chunk. Request r owns chunks chunk_offsets[r] ..
    chunk_offsets[r+1] - 1; chunk c covers tokens chunk_starts[c] .. chunk_starts[c+1] - 1
    (chunk_starts has one more entry than there are chunks: T)."""

    chunk_starts: list[int]
    chunk_offsets: list[int]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_starts) - 1


def plan_chunks(cu_seqlens: list[int], checkpoint_tokens: list[int], chunk_size: int = CHUNK) -> ChunkPlan:
    """Host-side chunking (prefill runs eagerly). checkpoint_tokens: tokens after which the state
    is checkpointed, in increasing order."""
    cuts = sorted(set(cu_seqlens[1:]) | {t + 1 for t in checkpoint_tokens})
    chunk_starts, chunk_offsets = [], [0]
    cut = 0
    for r in range(len(cu_seqlens) - 1):
        pos, end = cu_seqlens[r], cu_seqlens[r + 1]
        while pos < end:
            while cuts[cut] <= pos:
                cut += 1
            chunk_starts.append(pos)
            pos = min(pos + chunk_size, cuts[cut])
        chunk_offsets.append(len(chunk_starts))
    chunk_starts.append(cu_seqlens[-1])
    return ChunkPlan(chunk_starts, chunk_offsets)


def chunk_prepare_ref(
    kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor, qc: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One chunk's intra-chunk part, per value head (all float32): kc, qc [H, L, Dk], vc [H, L, Dv],
    gc [H, L] or [H, L, Dk] (log-decays), bc [H, L]. Returns the cumulative log-decay, the WY
    factors w = T (beta k e^gcum), u = T (beta v) with T = (I + strict_lower(beta_i k_i . k_j
    e^(gcum_i - gcum_j)))^-1, and the masked intra-chunk attention q_i . k_j e^(gcum_i - gcum_j), j <= i."""
    length = kc.shape[1]
    gcum = gc.cumsum(1)
    lower = torch.ones(length, length, dtype=torch.bool, device=kc.device).tril()
    if gc.dim() == 2:
        decay = (gcum[:, :, None] - gcum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        kk = kc @ kc.transpose(1, 2) * decay
        qk = qc @ kc.transpose(1, 2) * decay
        k_decayed = kc * gcum.exp()[:, :, None]
    else:  # per channel: the decay sits inside the sum over Dk
        diff = (gcum[:, :, None, :] - gcum[:, None, :, :]).masked_fill(~lower[:, :, None], float("-inf")).exp()
        kk = torch.einsum("hid,hjd,hijd->hij", kc, kc, diff)
        qk = torch.einsum("hid,hjd,hijd->hij", qc, kc, diff)
        k_decayed = kc * gcum.exp()
    system = torch.eye(length, device=kc.device) + (bc[:, :, None] * kk).tril(-1)
    w = torch.linalg.solve_triangular(system, bc[:, :, None] * k_decayed, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(system, bc[:, :, None] * vc, upper=False, unitriangular=True)
    return gcum, w, u, qk


def gated_delta_rule_chunked_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, scale: float, use_qk_l2norm: bool = True, checkpoint_slots: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> torch.Tensor:
    """The chunked form (WY representation, one UT transform per chunk), same contract as
    gated_delta_rule_ref: per chunk, v_new = u - w S; o = (q e^gcum) S + qk v_new;
    S = e^gcum_last S + (k e^(gcum_last - gcum))^T v_new."""
    check_gated_delta_args(q, k, v, g, beta, state, slots, cu_seqlens, has_initial_state, checkpoint_slots)
    qf, kf, vf, gf, bf = _prepared(q, k, v, g, beta, scale, use_qk_l2norm)
    per_channel = g.dim() == 3
    out = torch.empty_like(vf)
    checkpoints = checkpoint_slots.tolist() if checkpoint_slots is not None else [-1] * q.shape[0]
    plan = plan_chunks(cu_seqlens.tolist(), [t for t, c in enumerate(checkpoints) if c >= 0], chunk_size)
    for r, (slot, has_initial) in enumerate(zip(slots.tolist(), has_initial_state.tolist())):
        s = _initial(state, slot, has_initial)
        for c in range(plan.chunk_offsets[r], plan.chunk_offsets[r + 1]):
            first, end = plan.chunk_starts[c], plan.chunk_starts[c + 1]
            qc, kc, vc, gc = (x[first:end].transpose(0, 1) for x in (qf, kf, vf, gf))
            gcum, w, u, qk = chunk_prepare_ref(kc, vc, gc, bf[first:end].t(), qc)
            v_new = u - w @ s
            q_decayed = qc * (gcum.exp() if per_channel else gcum.exp()[:, :, None])
            out[first:end] = (q_decayed @ s + qk @ v_new).transpose(0, 1)
            last = gcum[:, -1:]  # [H, 1] or [H, 1, Dk]
            k_decayed = kc * ((last - gcum).exp() if per_channel else (last - gcum).exp()[:, :, None])
            s = s * (last.transpose(1, 2).exp() if per_channel else last.exp()[:, :, None]) + k_decayed.transpose(1, 2) @ v_new
            if checkpoints[end - 1] >= 0:
                state[checkpoints[end - 1]] = s.to(state.dtype)
        state[slot] = s.to(state.dtype)
    return out.to(v.dtype)

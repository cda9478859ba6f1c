"""Gated delta rule over a pool of per-request states (placeholder reference; the gdn-kernels
branch replaces this file with the reference and the Triton kernels behind the same functions)."""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                         has_initial_state: torch.Tensor, *, scale: float, use_qk_l2norm: bool = True,
                         checkpoint_slots: torch.Tensor | None = None) -> torch.Tensor:
    num_v_heads = v.shape[1]
    group = num_v_heads // k.shape[1]
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = cu_seqlens.tolist()
    checkpoints = None if checkpoint_slots is None else checkpoint_slots.tolist()
    for r, slot in enumerate(slots.tolist()):
        s = state[slot].float() if bool(has_initial_state[r]) else torch.zeros(state.shape[1:], device=v.device)
        for t in range(starts[r], starts[r + 1]):
            decay = g[t].float().exp()
            s = s * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            kv_mem = (s * kf[t, :, :, None]).sum(-2)
            delta = (v[t].float() - kv_mem) * beta[t].float()[:, None]
            s = s + kf[t, :, :, None] * delta[:, None, :]
            out[t] = (s * qf[t, :, :, None]).sum(-2)
            if checkpoints is not None and checkpoints[t] >= 0:
                state[checkpoints[t]] = s.to(state.dtype)
        state[slot] = s.to(state.dtype)
    return out.to(q.dtype)


gated_delta_rule = gated_delta_rule_ref

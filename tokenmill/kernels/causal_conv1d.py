"""Depthwise causal conv1d over a pool of per-request conv windows (placeholder reference; the
gdn-kernels branch replaces this file)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, *,
                      activation: str | None = "silu", checkpoint_slots: torch.Tensor | None = None) -> torch.Tensor:
    width = weight.shape[1] - 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    starts = cu_seqlens.tolist()
    checkpoints = None if checkpoint_slots is None else checkpoint_slots.tolist()
    for r, slot in enumerate(slots.tolist()):
        first, last = starts[r], starts[r + 1]
        prev = conv_state[slot] if bool(has_initial_state[r]) else torch.zeros_like(conv_state[slot])
        window = torch.cat((prev.to(weight.dtype), x[first:last].to(weight.dtype)))
        y = F.conv1d(window.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
        if activation == "silu":
            y = F.silu(y)
        out[first:last] = y.to(x.dtype)
        if checkpoints is not None:
            for t in range(first, last):
                if checkpoints[t] >= 0:
                    conv_state[checkpoints[t]] = window[t - first + 1 : t - first + 1 + width].to(conv_state.dtype)
        conv_state[slot] = window[-width:].to(conv_state.dtype)
    return out


causal_conv1d = causal_conv1d_ref

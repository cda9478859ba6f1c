"""Depthwise causal conv1d over packed variable-length batches with per-request windows in a slot
pool (the short convolution before Gated DeltaNet / KDA): the public entry point and its
PyTorch reference.

Request r owns rows cu_seqlens[r] .. cu_seqlens[r+1] - 1 of x [T, C]; conv_state [num_slots,
K-1, C] holds each request's last K-1 inputs, oldest first. Output row t is
    bias + sum_i weight[:, i] * ext[t + i],   ext = (window before the call) ++ x rows of r,
with SiLU after when activation == "silu". The window before the call is conv_state[slots[r]]
when has_initial_state[r], else zeros (the slot is not read); afterwards the slot holds the last
K-1 rows of ext (a request with fewer than K-1 inputs so far keeps zeros before its first).
checkpoint_slots[t] >= 0 also stores the window after row t there. Slots of one call are
distinct: no request slot is another's, nor a checkpoint's (rows sharing one, such as a CUDA
graph's padding rows on its scratch slot, leave garbage there and in their own outputs only).

On CUDA (or under TRITON_INTERPRET=1) the Triton kernels run: few rows per request (decode,
verification) take the update kernel alone, which reads nothing from the device on the host and
is graph-safe; otherwise a token-parallel kernel computes the rows, then the update kernel
stores the windows. On CPU without the interpreter the reference runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_ref"]

# As gated_delta.RECURRENT_MAX_TOKENS_PER_REQUEST: decided from shapes, so decode never syncs.
UPDATE_MAX_TOKENS_PER_REQUEST = 8


def check_conv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    activation: str | None, checkpoint_slots: torch.Tensor | None,
) -> None:
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if weight.shape != (channels, width) or width < 2:
        raise ValueError(f"weight must be [C, K] with K >= 2 for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [{channels}], got {tuple(bias.shape)}")
    if conv_state.shape[1:] != (width - 1, channels):
        raise ValueError(f"conv_state must be [slots, {width - 1}, {channels}], got {tuple(conv_state.shape)}")
    num_requests = slots.shape[0]
    if cu_seqlens.shape != (num_requests + 1,) or has_initial_state.shape != (num_requests,):
        raise ValueError("cu_seqlens must be [R + 1] and has_initial_state [R] for R = len(slots)")
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if checkpoint_slots is not None and checkpoint_slots.shape != (num_tokens,):
        raise ValueError(f"checkpoint_slots must be [T], got {tuple(checkpoint_slots.shape)}")


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, activation: str | None = "silu", checkpoint_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 math, one request at a time."""
    check_conv_args(x, weight, bias, conv_state, slots, cu_seqlens, has_initial_state, activation, checkpoint_slots)
    channels, width = weight.shape
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    starts = cu_seqlens.tolist()
    checkpoints = checkpoint_slots.tolist() if checkpoint_slots is not None else None
    w = weight.float()[:, None, :]
    b = bias.float() if bias is not None else None
    for r, (slot, has_initial) in enumerate(zip(slots.tolist(), has_initial_state.tolist())):
        first, end = starts[r], starts[r + 1]
        before = conv_state[slot].float() if has_initial else x.new_zeros(width - 1, channels, dtype=torch.float32)
        ext = torch.cat([before, x[first:end].float()])  # [K - 1 + L, C]
        out[first:end] = F.conv1d(ext.t()[None], w, b, groups=channels)[0].t()
        if checkpoints is not None:
            for t in range(first, end):
                if checkpoints[t] >= 0:
                    conv_state[checkpoints[t]] = ext[t - first + 1 : t - first + width].to(conv_state.dtype)
        conv_state[slot] = ext[end - first :].to(conv_state.dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, K - 1, C], read and written in place
    slots: torch.Tensor,  # [R] int32 (int64 also taken)
    cu_seqlens: torch.Tensor,  # [R + 1] int32
    has_initial_state: torch.Tensor,  # [R] bool
    *,
    activation: str | None = "silu",
    checkpoint_slots: torch.Tensor | None = None,  # [T] int32 (int64 also taken), -1: none
) -> torch.Tensor:  # [T, C] in x's dtype
    check_conv_args(x, weight, bias, conv_state, slots, cu_seqlens, has_initial_state, activation, checkpoint_slots)
    args = (x, weight, bias, conv_state, slots, cu_seqlens, has_initial_state)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return causal_conv1d_ref(*args, activation=activation, checkpoint_slots=checkpoint_slots)
    from tokenmill.kernels.causal_conv1d_triton import causal_conv1d_triton

    update_only = x.shape[0] <= UPDATE_MAX_TOKENS_PER_REQUEST * max(1, slots.shape[0])
    args = (x if x.stride(1) == 1 else x.contiguous(), *args[1:])
    return causal_conv1d_triton(*args, activation=activation, checkpoint_slots=checkpoint_slots, update_only=update_only)

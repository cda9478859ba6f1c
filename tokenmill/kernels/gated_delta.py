"""The gated delta rule (Gated DeltaNet, and KDA's per-channel gate) over packed variable-length
batches whose states live in a pool of slots: the public entry point. The contract and the math
are in gated_delta_ref.py, whose PyTorch forms are the references.

On CUDA (or under TRITON_INTERPRET=1) the Triton kernels run: a recurrent kernel when the batch
has few tokens per request (decode, speculative verification; no host sync, graph-safe) and the
chunked kernels otherwise (prefill and chunked prefill; the chunk plan is made on the host).
On CPU without the interpreter the PyTorch references run (the engine's CPU path).
"""

from __future__ import annotations

import os

import torch

from tokenmill.kernels.gated_delta_ref import (
    check_gated_delta_args,
    gated_delta_rule_chunked_ref,
    gated_delta_rule_ref,
)

__all__ = ["gated_delta_rule", "gated_delta_rule_ref", "gated_delta_rule_chunked_ref", "uses_recurrent_path"]

# Batches with at most this many tokens per request on average take the recurrent path, chosen
# from shapes alone so that decode and verification (1 + gamma tokens) never read the device.
RECURRENT_MAX_TOKENS_PER_REQUEST = 8


def uses_recurrent_path(num_tokens: int, num_requests: int) -> bool:
    return num_tokens <= RECURRENT_MAX_TOKENS_PER_REQUEST * max(1, num_requests)


def _triton_wanted(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """What the kernels take: unit stride along the last dim, k strided as q (views of one
    projection are, untouched), g in float32, the pool contiguous (written in place, never copied)."""
    if not state.is_contiguous():
        raise ValueError("the state pool must be contiguous: it is written in place")
    q, k, v, beta = (_unit_rows(x) for x in (q, k, v, beta))
    if k.stride() != q.stride():
        q, k = q.contiguous(), k.contiguous()
    return q, k, v, _unit_rows(g.float()), beta


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv], Hv a multiple of Hk
    g: torch.Tensor,  # float32 log-decay [T, Hv] or [T, Hv, Dk] (KDA)
    beta: torch.Tensor,  # [T, Hv], already through the sigmoid
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32 or bfloat16, read and written in place
    slots: torch.Tensor,  # [R] int32 (int64 also taken)
    cu_seqlens: torch.Tensor,  # [R + 1] int32
    has_initial_state: torch.Tensor,  # [R] bool
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    checkpoint_slots: torch.Tensor | None = None,  # [T] int32 (int64 also taken), -1: none
) -> torch.Tensor:  # [T, Hv, Dv] in v's dtype
    check_gated_delta_args(q, k, v, g, beta, state, slots, cu_seqlens, has_initial_state, checkpoint_slots)
    num_tokens, num_requests = q.shape[0], slots.shape[0]
    recurrent = uses_recurrent_path(num_tokens, num_requests)
    args = (q, k, v, g, beta, state, slots, cu_seqlens, has_initial_state)
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, checkpoint_slots=checkpoint_slots)
    if not _triton_wanted(q.device):
        return gated_delta_rule_ref(*args, **kwargs) if recurrent else gated_delta_rule_chunked_ref(*args, **kwargs)
    args = (*kernel_inputs(q, k, v, g, beta, state), state, slots, cu_seqlens, has_initial_state)
    if recurrent:
        from tokenmill.kernels.gated_delta_recurrent import recurrent_gated_delta_rule

        return recurrent_gated_delta_rule(*args, **kwargs)
    from tokenmill.kernels.gated_delta_chunk import chunk_gated_delta_rule

    return chunk_gated_delta_rule(*args, **kwargs)

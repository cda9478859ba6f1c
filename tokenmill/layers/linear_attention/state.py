"""The per-request state of linear-attention layers (Gated DeltaNet, KDA): short causal-conv
windows and a delta-rule state per head, in slots of a pool (a `RecurrentStateSpec`), where one
forward reads and writes them (`RecurrentBatch`), and the core both layers share
(`short_conv_delta_rule`: the conv over q | k | v, then the gated delta rule).

A request's rows read its slot's state (or zeros on its first chunk: a request whose first row
is at position 0 starts afresh, whatever the slot held) and write the state after their last
row back. A row with a checkpoint slot also writes the state after it there: speculative
verification keeps the state after every draft position, prefix caching takes snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tokenmill.kv.specs import RecurrentStateSpec, StateTensor
from tokenmill.layers.step_context import StepContext

DELTA_STATE = "ssm"


def conv_delta_spec(convs: Mapping[str, tuple[int, int]], conv_dtype: torch.dtype, num_heads: int, key_dim: int,
                    value_dim: int, state_dtype: torch.dtype) -> RecurrentStateSpec:
    """Conv windows `name -> (kernel width, channels)`, each [width - 1, channels] (time-major: the
    last inputs), and the delta-rule state [num_heads, key_dim, value_dim]."""
    windows = tuple(StateTensor(name, (width - 1, channels), conv_dtype) for name, (width, channels) in convs.items())
    return RecurrentStateSpec((*windows, StateTensor(DELTA_STATE, (num_heads, key_dim, value_dim), state_dtype)),
                              writes_checkpoints=True)


@dataclass
class RecurrentBatch:
    """Where each request's state lives in one forward; built once per forward, shared by every
    recurrent layer. Device tensors only: nothing here reads back to the host."""

    slots: torch.Tensor  # [R] int64: each request's slot
    cu_seqlens: torch.Tensor  # [R + 1] int32: request r owns rows cu_seqlens[r]:cu_seqlens[r + 1]
    has_initial_state: torch.Tensor  # [R] bool: False starts from zeros
    checkpoint_slots: torch.Tensor | None  # [T] int64: after row t also write the state there (-1: none)

    @classmethod
    def of(cls, ctx: StepContext) -> RecurrentBatch:
        if ctx.state_slots is None:
            raise ValueError("a model with recurrent layers needs a state slot per request")
        starts = ctx.attention.query_start_loc
        return cls(ctx.state_slots, starts, ctx.positions[starts[:-1].long()] > 0, ctx.state_checkpoints)


@dataclass(frozen=True)
class DeltaHeads:
    """The head layout of a delta-rule layer: value head h reads key head h // (value_heads / key_heads)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv over q | k | v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def short_conv_delta_rule(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor,
                          delta_state: torch.Tensor, heads: DeltaHeads, g: torch.Tensor, beta: torch.Tensor,
                          batch: RecurrentBatch, use_triton: bool) -> torch.Tensor:
    """q, k, v = silu(causal depthwise conv(mixed = q | k | v [T, conv_dim], conv_weight [conv_dim, K]));
    the gated delta rule over them (q, k L2-normalised, scale key_dim^-0.5) with log-decay g
    ([T, Hv] per head or [T, Hv, Dk] per key channel, float32) and beta [T, Hv]: [T, Hv, Dv]. Both
    the conv window and the delta-rule state are read from and written to the batch's slots (and
    its checkpoint slots)."""
    tokens = mixed.shape[0]
    conv, delta_rule = conv_delta_kernels(use_triton, tokens, batch.slots.shape[0])
    mixed = conv(mixed, conv_weight, None, conv_state, batch.slots, batch.cu_seqlens, batch.has_initial_state,
                 activation="silu", checkpoint_slots=batch.checkpoint_slots)
    key_width = heads.key_heads * heads.key_dim
    q, k, v = mixed.split([key_width, key_width, heads.value_heads * heads.value_dim], dim=-1)
    return delta_rule(q.reshape(tokens, heads.key_heads, heads.key_dim), k.reshape(tokens, heads.key_heads, heads.key_dim),
                      v.reshape(tokens, heads.value_heads, heads.value_dim), g, beta, delta_state, batch.slots,
                      batch.cu_seqlens, batch.has_initial_state, scale=heads.key_dim**-0.5, use_qk_l2norm=True,
                      checkpoint_slots=batch.checkpoint_slots)


def conv_delta_kernels(use_triton: bool, num_tokens: int, num_requests: int) -> tuple[Callable[..., torch.Tensor], ...]:
    """(causal conv1d, gated delta rule): the Triton entry points, or the PyTorch references (the
    recurrent form for decode-sized batches, the chunked form for prefill)."""
    if use_triton:
        from tokenmill.kernels.causal_conv1d import causal_conv1d
        from tokenmill.kernels.gated_delta import gated_delta_rule

        return causal_conv1d, gated_delta_rule
    from tokenmill.kernels.causal_conv1d import causal_conv1d_ref
    from tokenmill.kernels.gated_delta import gated_delta_rule_chunked_ref, gated_delta_rule_ref, uses_recurrent_path

    return causal_conv1d_ref, (gated_delta_rule_ref if uses_recurrent_path(num_tokens, num_requests)
                               else gated_delta_rule_chunked_ref)

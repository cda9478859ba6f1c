"""The per-request state of linear-attention layers (Gated DeltaNet now, KDA beside it later):
short causal-conv windows and a delta-rule state per head, in slots of a pool (a
`RecurrentStateSpec`), and where one forward reads and writes them (`RecurrentBatch`).

A request's rows read its slot's state (or zeros on its first chunk: a request whose first row
is at position 0 starts afresh, whatever the slot held) and write the state after their last
row back. A row with a checkpoint slot also writes the state after it there: speculative
verification keeps the state after every draft position, prefix caching takes snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping
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

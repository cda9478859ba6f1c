"""Looking back a fixed number of rows per request in a packed batch.

Layers whose output at a token depends on the few tokens before it (a short convolution, the
n-gram context) keep each request's last L rows in a state slot (oldest first). In a packed
batch a token's earlier rows are in the same chunk or, before the chunk's first token, in its
request's slot, never in the request packed before it. `RequestWindows` puts the slots' rows
(`fill` for a request that starts at position 0) in front of the chunk rows, `ext`, and indexes
into it; every index is computed on the device, so a step stays free of host reads. A step with
state checkpoints (`StepContext.state_checkpoints`: draft rollback, prefix-cache snapshots) also
stores the window after each such token in its checkpoint slot, as the recurrent layers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.step_context import StepContext


@dataclass
class RequestWindows:
    slots: torch.Tensor  # [B] int64: each request's state slot
    starts: torch.Tensor  # [B] int64: its first row in the batch
    ends: torch.Tensor  # [B] int64: one past its last row
    token_rows: torch.Tensor  # [T] int64: the request of each row
    fresh: torch.Tensor  # [B] bool: the request's chunk starts at position 0 (its slot holds nothing yet)
    checkpoints: torch.Tensor | None = None  # [T]: also store the window after this token in this slot (-1: none)

    @classmethod
    def of(cls, ctx: StepContext) -> RequestWindows:
        if ctx.state_slots is None:
            raise ValueError("a layer that keeps per-request windows needs the step's state slots")
        qsl = ctx.attention.query_start_loc.long()
        num_tokens = ctx.num_tokens
        starts = qsl[:-1]
        token_rows = ctx.token_rows
        if token_rows is None:
            token_rows = torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=qsl.device), right=True)
        return cls(ctx.state_slots, starts, qsl[1:], token_rows, ctx.positions[starts.clamp(max=num_tokens - 1)] == 0,
                   ctx.state_checkpoints)

    @property
    def num_requests(self) -> int:
        return self.slots.shape[0]

    def extend(self, rows: torch.Tensor, state: torch.Tensor, fill: float | int) -> torch.Tensor:
        """[B * L + T, ...]: each request's previous L rows (from its slot of `state` [slots, L, ...],
        or `fill` when fresh), then the batch's `rows` [T, ...]."""
        previous = state[self.slots]
        fresh = self.fresh.view(-1, *[1] * (previous.dim() - 1))
        previous = torch.where(fresh, torch.full_like(previous, fill), previous)
        return torch.cat([previous.flatten(0, 1), rows.to(state.dtype)])

    def back(self, offset: int, length: int) -> torch.Tensor:
        """[T]: the row of `ext` holding the input `offset` (1 .. L) positions before each token."""
        if not 1 <= offset <= length:
            raise ValueError(f"a window of {length} rows cannot look back {offset}")
        t = torch.arange(self.token_rows.shape[0], device=self.token_rows.device)
        local = t - self.starts[self.token_rows]
        in_chunk = self.num_requests * length + t - offset
        in_slot = self.token_rows * length + length + local - offset
        return torch.where(local >= offset, in_chunk, in_slot)

    def last(self, length: int) -> torch.Tensor:
        """[B, L]: the rows of `ext` holding each request's last L inputs after this step, oldest first."""
        rel = (self.ends - self.starts)[:, None] - length + torch.arange(length, device=self.slots.device)
        in_chunk = self.num_requests * length + self.starts[:, None] + rel
        in_slot = torch.arange(self.num_requests, device=self.slots.device)[:, None] * length + length + rel
        return torch.where(rel >= 0, in_chunk, in_slot)

    def store(self, state: torch.Tensor, ext: torch.Tensor, length: int) -> None:
        """Each request's slot of `state` becomes its last L inputs; a checkpoint slot, the L
        inputs up to its token (rows without one write the scratch slot, the pool's last)."""
        if self.checkpoints is not None:
            t = torch.arange(self.token_rows.shape[0], device=ext.device)
            rows = [self.back(m, length) for m in range(length - 1, 0, -1)] + [self.num_requests * length + t]
            target = torch.where(self.checkpoints >= 0, self.checkpoints.long(), state.shape[0] - 1)
            state.index_copy_(0, target, ext[torch.stack(rows, dim=1)])
        state[self.slots] = ext[self.last(length)]

"""The state manager: slots of the recurrent-state pools (conv windows, delta-rule states) for
running requests, whatever the context length.

A request takes its slots when first scheduled and gives them back when it finishes, is aborted
or is preempted (recompute rebuilds the state from its first token, or from a prefix snapshot).
It holds one slot, its state, and with speculative decoding `num_spares` more: a verify step of
1 + d rows writes the state after row i < d into spare i (a checkpoint row) and the state after
its last row into the request's slot. Rolling back to the state after row tau < d re-points the
request at spare tau and makes its old slot a spare: no state is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv.paged import CachedRequest

NO_CHECKPOINT = -1


@dataclass
class _Held:
    slots: list[int]  # [its state, spare 0, spare 1, ...]
    verify_start: int | None = None  # first position of its last step with checkpoint rows


class StateSlotManager:
    def __init__(self, num_slots: int, num_spares: int = 0) -> None:
        """num_slots: the pool's slots for running requests (1 + num_spares per request)."""
        self.num_slots = num_slots
        self.num_spares = num_spares
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.held: dict[str, _Held] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def slots_per_request(self) -> int:
        return 1 + self.num_spares

    def can_allocate(self, request: CachedRequest) -> bool:
        return request.request_id in self.held or len(self.free_slots) >= self.slots_per_request

    def allocate(self, request: CachedRequest) -> None:
        if request.request_id not in self.held:
            self.held[request.request_id] = _Held([self.free_slots.pop() for _ in range(self.slots_per_request)])

    def slot(self, request_id: str) -> int:
        return self.held[request_id].slots[0]

    def free(self, request: CachedRequest) -> None:
        held = self.held.pop(request.request_id, None)
        if held is not None:
            self.free_slots.extend(reversed(held.slots))

    def verify_checkpoints(self, request: CachedRequest, start: int, num_rows: int) -> list[int]:
        """Checkpoint slots of a verify step's rows (positions start..): spare i after row i, none
        after the last row (its state goes to the request's slot)."""
        if num_rows - 1 > self.num_spares:
            raise ValueError(f"{num_rows - 1} drafts but {self.num_spares} spare state slots per request")
        held = self.held[request.request_id]
        held.verify_start = start
        return held.slots[1:num_rows] + [NO_CHECKPOINT]

    def rollback(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Make the request's state the one after its first num_computed_tokens tokens: the
        checkpoint its last verify step wrote after that position."""
        held = self.held.get(request.request_id)
        if held is None:
            return
        row = num_computed_tokens - 1 - (held.verify_start if held.verify_start is not None else num_computed_tokens)
        if not 0 <= row < self.num_spares:
            raise ValueError(f"request {request.request_id}: no state checkpoint after position "
                             f"{num_computed_tokens - 1} (its last verify step started at {held.verify_start})")
        slots = held.slots
        slots[0], slots[1 + row] = slots[1 + row], slots[0]
        held.verify_start = None

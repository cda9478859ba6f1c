"""The state manager: one slot per running request in the recurrent-state pools (conv windows,
delta-rule states), whatever the context length.

A request takes a slot when first scheduled and gives it back when it finishes, is aborted or
is preempted (recompute rebuilds the state from its first token). The state after a prefix is
not kept past the request yet, so a prefix-cache hit cannot resume a stateful model: the
coordinator then finds no hit.
"""

from __future__ import annotations

from tokenmill.kv.paged import CachedRequest


class StateSlotManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slots: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def cached_prefix_blocks(self, request: CachedRequest, paged_hits: int) -> int:
        """How many of the paged prefix hits the state can resume from: none (no snapshots)."""
        return 0

    def can_allocate(self, request: CachedRequest) -> bool:
        return request.request_id in self.slots or bool(self.free_slots)

    def allocate(self, request: CachedRequest) -> None:
        if request.request_id not in self.slots:
            self.slots[request.request_id] = self.free_slots.pop()

    def slot(self, request_id: str) -> int:
        return self.slots[request_id]

    def free(self, request: CachedRequest) -> None:
        slot = self.slots.pop(request.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def rollback(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Restoring the state after an earlier token needs a checkpoint per position, which this
        manager does not keep: a configuration that would roll a state back is refused at start-up."""
        raise NotImplementedError("recurrent state cannot be rolled back without per-position checkpoints")

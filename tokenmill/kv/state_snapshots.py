"""Prefix caching for recurrent state: snapshots of the state after a prefix, in slots of the same
pools as the running requests' states, keyed by the chained hash of the block the prefix ends
with (the paged prefix cache's keys, cache_salt included), evicted least recently used.

Paged KV stays in small blocks; the state is snapshotted at block boundaries only: every
`interval` tokens (a multiple of the block size) and at the last full block of each prompt. A
prefix hit resumes from the deepest snapshot at or below the paged hit (the coordinator trims
the paged hit to it) and recomputes the rest; resuming copies the snapshot into the request's
slot before its first forward.

A snapshot slot is taken when a step with a boundary row is built (that row writes the state
there: a checkpoint row), published under its block's hash once the block's tokens are computed
and known on the host, and dropped if its request ends before that. Slots are integers here;
the tensors belong to the cache layers, the copies to the runner.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockHash
from tokenmill.kv.paged import CachedRequest


@dataclass
class SnapshotCounters:
    lookups: int = 0  # prefix lookups with a paged hit
    hits: int = 0  # of those, with a snapshot to resume from
    taken: int = 0  # snapshots written
    evicted: int = 0


class StateSnapshotCache:
    def __init__(self, first_slot: int, num_slots: int, block_size: int, interval: int) -> None:
        if interval % block_size:
            raise ValueError(f"snapshot interval {interval} is not a multiple of the block size {block_size}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.interval = interval
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request -> [(block index, slot)] not yet published
        self.pinned: set[int] = set()  # slots a step being built copies from
        self.counters = SnapshotCounters()

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def deepest(self, request: CachedRequest, paged_hits: int) -> tuple[int, int | None]:
        """(blocks, snapshot slot) of the deepest snapshot on the request's first paged_hits blocks,
        (0, None) when there is none. Marks it used."""
        for blocks in range(paged_hits, 0, -1):
            slot = self.cached.get(request.block_hashes[blocks - 1])
            if slot is not None:
                self.cached.move_to_end(request.block_hashes[blocks - 1])
                return blocks, slot
        return 0, None

    def pin(self, slot: int) -> None:
        self.pinned.add(slot)

    def unpin_all(self) -> None:
        self.pinned.clear()

    def boundary_rows(self, request: CachedRequest, prompt_len: int, start: int, num_rows: int) -> dict[int, int]:
        """Rows of a step (positions start..start + num_rows - 1) after which the state is a new
        snapshot, each with the slot it goes to (rows whose snapshot exists are left out)."""
        rows: dict[int, int] = {}
        prompt_end = prompt_len // self.block_size * self.block_size
        first = start // self.block_size + 1
        for boundary in range(first * self.block_size, start + num_rows + 1, self.block_size):
            if boundary % self.interval and boundary != prompt_end:
                continue
            index = boundary // self.block_size - 1
            hashes = request.block_hashes
            if index < len(hashes) and hashes[index] in self.cached:
                self.cached.move_to_end(hashes[index])
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self.pending.setdefault(request.request_id, []).append((index, slot))
            rows[boundary - 1 - start] = slot
        return rows

    def publish(self, request: CachedRequest) -> None:
        """Cache the request's written snapshots whose blocks it has computed and knows."""
        pending = self.pending.get(request.request_id)
        if not pending:
            return
        known = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        waiting = []
        for index, slot in pending:
            if index >= known or index >= len(request.block_hashes):
                waiting.append((index, slot))
                continue
            block_hash = request.block_hashes[index]
            if block_hash in self.cached:  # another request wrote the same prefix first
                self.free_slots.append(slot)
            else:
                self.cached[block_hash] = slot
                self.counters.taken += 1
        if waiting:
            self.pending[request.request_id] = waiting
        else:
            del self.pending[request.request_id]

    def drop(self, request: CachedRequest) -> None:
        """Give back the slots of snapshots the request will not publish (it ended or was
        preempted; a step that wrote them has been launched and may still be running, which is
        fine: a slot is only written again by a later step)."""
        for _, slot in self.pending.pop(request.request_id, []):
            self.free_slots.append(slot)

    def _take_slot(self) -> int | None:
        if not self.free_slots:
            victim = next((h for h, s in self.cached.items() if s not in self.pinned), None)
            if victim is None:
                return None
            self.free_slots.append(self.cached.pop(victim))
            self.counters.evicted += 1
        return self.free_slots.pop()

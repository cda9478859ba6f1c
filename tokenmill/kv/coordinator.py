"""The coordinator: one request's caches across every manager — paged blocks (shared by every
paged layer), recurrent-state slots and state snapshots — allocated, prefix-matched, freed and
rolled back together."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.paged import CacheCounters, CachedRequest, PagedCacheManager
from tokenmill.kv.planner import CachePlan
from tokenmill.kv.state import NO_CHECKPOINT, StateSlotManager
from tokenmill.kv.state_snapshots import StateSnapshotCache


class KVCacheCoordinator:
    def __init__(self, plan: CachePlan, enable_prefix_caching: bool, state_interval: int = 256,
                 recompute_last_hit_block: bool = False) -> None:
        self.paged = PagedCacheManager(plan.num_blocks, plan.block_size, enable_prefix_caching, recompute_last_hit_block)
        self.state: StateSlotManager | None = None
        self.snapshots: StateSnapshotCache | None = None
        if plan.bytes_per_state_slot:
            self.state = StateSlotManager(plan.num_state_slots, plan.state_slots_per_seq - 1)
            if enable_prefix_caching and plan.num_snapshot_slots:
                self.snapshots = StateSnapshotCache(plan.first_snapshot_slot, plan.num_snapshot_slots, plan.block_size,
                                                    state_interval)
        self.bytes_per_state_slot = plan.bytes_per_state_slot
        self._state_copies: list[tuple[int, int]] = []  # (snapshot slot, request slot) before the next forward

    @classmethod
    def paged_only(cls, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> KVCacheCoordinator:
        """A coordinator of paged caches alone (every Llama-family model)."""
        return cls(CachePlan(num_blocks, 0, block_size, bytes_per_block=1, bytes_per_state_slot=0), enable_prefix_caching)

    # What the scheduler, engine and proposers read.
    @property
    def block_size(self) -> int:
        return self.paged.block_size

    @property
    def num_blocks(self) -> int:
        return self.paged.num_blocks

    @property
    def pool(self) -> BlockPool:
        return self.paged.pool

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return self.paged.block_tables

    @property
    def counters(self) -> CacheCounters:
        return self.paged.counters

    def snapshot_stats(self) -> dict[str, int]:
        """The state snapshot pool's counters and bytes (none without a pool), as EngineStats names them."""
        snapshots, per_slot = self.snapshots, self.bytes_per_state_slot
        if snapshots is None:
            return {}
        return dict(state_snapshot_lookups=snapshots.counters.lookups, state_snapshot_hits=snapshots.counters.hits,
                    state_snapshots_cached=snapshots.num_cached, state_snapshot_bytes_used=snapshots.num_cached * per_slot,
                    state_snapshot_bytes_total=snapshots.num_slots * per_slot)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.paged.blocks_needed(num_tokens)

    def state_slot(self, request_id: str) -> int | None:
        return None if self.state is None else self.state.slot(request_id)

    def find_cached_prefix(self, request: CachedRequest) -> list[int]:
        """Cached blocks matching the request's leading full blocks, as deep as every manager can
        resume from; leaves >= 1 token to compute."""
        hits = self.paged.find_cached_prefix(request)
        paged_hits = len(hits)
        if self.state is not None and hits:
            depth = self.snapshots.deepest(request, len(hits))[0] if self.snapshots is not None else 0
            if self.snapshots is not None:
                self.snapshots.counters.lookups += 1
                self.snapshots.counters.hits += depth > 0
            hits = hits[:depth]
        if self.paged.enable_prefix_caching:
            self.counters.queried_tokens += request.num_tokens
            self.counters.hit_tokens += len(hits) * self.block_size
            self.counters.paged_hit_tokens += paged_hits * self.block_size
        return hits

    def allocate_slots(self, request: CachedRequest, num_new_tokens: int, cached_blocks: Sequence[int] = (),
                       reserve: int = 0) -> bool:
        """Give the request room for `num_new_tokens` past its computed (and cached) tokens, and
        state slots (resumed from the snapshot of its cached prefix), leaving `reserve` blocks free.
        Returns False, changing nothing, when a manager cannot supply it."""
        if not self.paged.can_allocate(request, num_new_tokens, cached_blocks, reserve):
            return False
        if self.state is not None and not self.state.can_allocate(request):
            return False
        self.paged.allocate(request, num_new_tokens, cached_blocks)
        if self.state is not None:
            self.state.allocate(request)
            if cached_blocks and self.snapshots is not None:
                depth, snapshot = self.snapshots.deepest(request, len(cached_blocks))
                assert depth == len(cached_blocks) and snapshot is not None, "the prefix hit was trimmed to a snapshot"
                self.snapshots.pin(snapshot)
                self._state_copies.append((snapshot, self.state.slot(request.request_id)))
        return True

    def take_state_copies(self) -> list[tuple[int, int]]:
        """(source, destination) slots to copy before the next forward: snapshots that requests
        admitted since the last call resume from."""
        copies, self._state_copies = self._state_copies, []
        if self.snapshots is not None:
            self.snapshots.unpin_all()
        return copies

    def state_checkpoints(self, request: CachedRequest, prompt_len: int, start: int, num_rows: int,
                          verifying: bool) -> list[int] | None:
        """Per row of a step (positions start..), the state slot to write the state after it into,
        or None when no row has one: spares of a verify step (for rollback), else snapshot slots at
        the boundaries this step crosses."""
        if self.state is None:
            return None
        if verifying:
            return self.state.verify_checkpoints(request, start, num_rows)
        if self.snapshots is None:
            return None
        self.paged.update_hashes(request)
        rows = self.snapshots.boundary_rows(request, prompt_len, start, num_rows)
        return [rows.get(i, NO_CHECKPOINT) for i in range(num_rows)] if rows else None

    def register_computed_blocks(self, request: CachedRequest) -> None:
        self.paged.register_computed_blocks(request)
        if self.snapshots is not None:
            self.paged.update_hashes(request)
            self.snapshots.publish(request)

    def free(self, request: CachedRequest, keep_snapshots: bool = True) -> None:
        """keep_snapshots: publish the state snapshots the request's launched steps wrote (not
        after a failed step, which may not have written them)."""
        if self.snapshots is not None:
            if keep_snapshots:
                self.paged.update_hashes(request)
                self.snapshots.publish(request)
            self.snapshots.drop(request)
        self.paged.free(request)
        if self.state is not None:
            self.state.free(request)

    def rollback(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Forget what the caches computed past num_computed_tokens (rejected drafts)."""
        self.paged.rollback(request, num_computed_tokens)
        if self.state is not None:
            self.state.rollback(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens

"""The coordinator: one request's caches across every manager — paged blocks (shared by every
paged layer) and a recurrent-state slot — allocated, prefix-matched, freed and rolled back together."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.paged import CacheCounters, CachedRequest, PagedCacheManager
from tokenmill.kv.planner import CachePlan
from tokenmill.kv.state import StateSlotManager


class KVCacheCoordinator:
    def __init__(self, plan: CachePlan, enable_prefix_caching: bool) -> None:
        self.paged = PagedCacheManager(plan.num_blocks, plan.block_size, enable_prefix_caching)
        self.state = StateSlotManager(plan.num_state_slots) if plan.bytes_per_state_slot else None

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

    def blocks_needed(self, num_tokens: int) -> int:
        return self.paged.blocks_needed(num_tokens)

    def state_slot(self, request_id: str) -> int | None:
        return None if self.state is None else self.state.slot(request_id)

    def find_cached_prefix(self, request: CachedRequest) -> list[int]:
        """Cached blocks matching the request's leading full blocks, as deep as every manager can
        resume from; leaves >= 1 token to compute."""
        hits = self.paged.find_cached_prefix(request)
        if self.state is not None and hits:
            hits = hits[: self.state.cached_prefix_blocks(request, len(hits))]
        if self.paged.enable_prefix_caching:
            self.counters.queried_tokens += request.num_tokens
            self.counters.hit_tokens += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: CachedRequest, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give the request room for `num_new_tokens` past its computed (and cached) tokens, and a
        state slot. Returns False, changing nothing, when a manager cannot supply it."""
        if not self.paged.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        if self.state is not None and not self.state.can_allocate(request):
            return False
        self.paged.allocate(request, num_new_tokens, cached_blocks)
        if self.state is not None:
            self.state.allocate(request)
        return True

    def register_computed_blocks(self, request: CachedRequest) -> None:
        self.paged.register_computed_blocks(request)

    def free(self, request: CachedRequest) -> None:
        self.paged.free(request)
        if self.state is not None:
            self.state.free(request)

    def rollback(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Forget what the caches computed past num_computed_tokens (rejected drafts)."""
        self.paged.rollback(request, num_computed_tokens)
        if self.state is not None:
            self.state.rollback(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens

"""The paged manager: maps requests to block ids (shared by every paged cache layer), finds and
registers cached prefixes. Only integers live here; the tensors belong to the cache layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenmill.kv.block_pool import BlockHash, BlockPool, hash_block


class CachedRequest(Protocol):
    """What the cache managers read of a request (tokenmill.engine.request.Request)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    block_hashes: list[BlockHash]

    @property
    def cache_tags(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass
class CacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0  # tokens resumed from the cache (every cache kind could)
    paged_hit_tokens: int = 0  # tokens the paged blocks alone matched (more, when a state snapshot was shallower)


class PagedCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 recompute_last_hit_block: bool = False) -> None:
        """recompute_last_hit_block: a prefix hit leaves its last matched block to compute again (an
        MTP head's row at a block's last position depends on the token after the block, which the
        request computing it may not share; vLLM does the same for its EAGLE/MTP drafts)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}
        self.counters = CacheCounters()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: CachedRequest) -> list[int]:
        """Cached blocks matching the request's leading full blocks; leaves >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits[:-1] if self.recompute_last_hit_block else hits

    def can_allocate(self, request: CachedRequest, num_new_tokens: int, cached_blocks: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether the new blocks fit in the free ones (cached blocks revived from the free queue
        count as taken) with `reserve` blocks left over."""
        table = self.block_tables.get(request.request_id, [])
        return self._num_new_blocks(request, table, num_new_tokens, cached_blocks) + reserve <= self.pool.num_free - sum(
            1 for b in cached_blocks if self.pool.ref_counts[b] == 0)

    def allocate(self, request: CachedRequest, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> None:
        """Room for num_new_tokens past the computed (and cached) tokens; call after can_allocate."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_new_blocks = self._num_new_blocks(request, table, num_new_tokens, cached_blocks)
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if cached_blocks:
            self.num_registered[request.request_id] = len(cached_blocks)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))

    def _num_new_blocks(self, request: CachedRequest, table: list[int], num_new_tokens: int,
                        cached_blocks: Sequence[int]) -> int:
        total_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        return self.blocks_needed(total_tokens) - len(table) - len(cached_blocks)

    def register_computed_blocks(self, request: CachedRequest) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request.request_id]
        done = self.num_registered.get(request.request_id, 0)
        full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if full <= done:
            return
        self.update_hashes(request)
        for i in range(done, full):
            self.pool.cache(table[i], request.block_hashes[i])
        self.num_registered[request.request_id] = full

    def free(self, request: CachedRequest) -> None:
        table = self.block_tables.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        if table:
            # Tail blocks are the least likely to be shared: put them first in line for eviction.
            self.pool.free(reversed(table))

    def rollback(self, request: CachedRequest, num_computed_tokens: int) -> None:
        """Forget KV past num_computed_tokens (rejected drafts): arithmetic only. Their slots hold
        KV the sequence does not own any more, recomputed before anything reads it; registration
        only ever covers host-known, computed tokens."""

    def update_hashes(self, request: CachedRequest) -> None:
        """Hash the request's full host-known blocks not hashed yet."""
        hashes = request.block_hashes
        num_full = len(request.all_token_ids) // self.block_size
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt,
                                     request.cache_tags))

"""KV block bookkeeping: a block pool with a prefix cache, and per-request block tables.

Only integers live here; the KV tensors themselves belong to the model runner. A block's KV
is identified by a chained hash of every token up to the end of the block (plus a type-tagged
cache salt in the first block), so two requests share a cached block exactly when they share
the whole prefix up to it under the same salt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenmill.engine.request import Request

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None) -> BlockHash:
    """The chained hash of one full block. The salt enters the first block only, type-tagged."""
    h = hashlib.sha256(parent or b"tokenmill-kv-v1")
    if parent is None and cache_salt is not None:
        h.update(b"cache_salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))  # any str, even a lone surrogate
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Fixed set of block ids with reference counts and an LRU queue of free blocks.

    A free block may still hold a cached prefix (its hash stays in `cached` until the block is
    handed out again), so cache hits can revive it. The free queue pops the least recently
    freed block first.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def _evict(self, block: int) -> None:
        old = self.block_hash[block]
        if old is not None:
            del self.cached[old]
            self.block_hash[block] = None


@dataclass
class CacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0


class KVCacheManager:
    """Maps requests to blocks; finds and registers cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}
        self.counters = CacheCounters()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks; leaves >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.counters.queried_tokens += request.num_tokens
        self.counters.hit_tokens += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give the request room for `num_new_tokens` past its computed (and cached) tokens.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        total_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(table) - len(cached_blocks)
        reviving = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks > self.pool.num_free - reviving:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(cached_blocks)
        table.extend(cached_blocks)
        if cached_blocks:
            self.num_registered[request.request_id] = len(cached_blocks)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request.request_id]
        done = self.num_registered.get(request.request_id, 0)
        full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        if full <= done:
            return
        self._update_hashes(request)
        for i in range(done, full):
            self.pool.cache(table[i], request.block_hashes[i])
        self.num_registered[request.request_id] = full

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        if table:
            # Tail blocks are the least likely to be shared: put them first in line for eviction.
            self.pool.free(reversed(table))

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = len(request.all_token_ids) // self.block_size
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt))

"""A fixed set of block ids with reference counts, an LRU queue of free blocks and the prefix
cache's hash -> block map; and the chained block hash that keys it.

A block's KV is identified by a chained hash of every token up to the end of the block (plus a
type-tagged cache salt and the request's other cache tags, its steering strengths, in the first
block), so two requests share a cached block exactly when they share the whole prefix up to it
under the same salt and tags.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None,
               tags: Sequence[tuple[str, str]] = ()) -> BlockHash:
    """The chained hash of one full block. The salt and the (tag, value) pairs enter the first block
    only, each type-tagged and length-prefixed (no salt can spell a tag)."""
    h = hashlib.sha256(parent or b"tokenmill-kv-v1")
    if parent is None:
        keyed = ([("cache_salt", cache_salt)] if cache_salt is not None else []) + list(tags)
        for tag, value in keyed:
            data = value.encode("utf-8", "surrogatepass")  # any str, even a lone surrogate
            h.update(tag.encode() + b"\x00" + len(data).to_bytes(8, "little") + data)
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

"""Block pool and prefix cache: chained hashes, salts, least-recently-used eviction."""

from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool, hash_block
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), eos_token_ids=frozenset(),
                   max_tokens=4, cache_salt=salt)


def test_hashes_chain_and_salt_only_changes_the_chain() -> None:
    first = hash_block(None, [1, 2], None)
    assert hash_block(first, [3, 4], None) != hash_block(hash_block(None, [9, 9], None), [3, 4], None)
    assert hash_block(None, [1, 2], "a") != first != hash_block(None, [1, 2], "b")
    # The salt is type-tagged: a salt cannot collide with tokens that spell the same bytes.
    assert hash_block(None, [1, 2], "") != first


def test_any_str_salts_the_hash() -> None:
    """Lone surrogates (half an emoji from a JavaScript client) hash too, each salt to its own chain."""
    salts = ["\ud83d", "\ude00", "\ud83d\ude00", "\U0001f600", "?", "\ud83d\ud83d"]
    hashes = {hash_block(None, [1, 2], salt) for salt in salts}
    assert len(hashes) == len(salts)


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.lookup(b"A") == a and pool.lookup(b"B") == b  # free blocks keep their prefix
    assert pool.allocate(1) == [a]  # least recently freed goes first, and its prefix with it
    assert pool.lookup(b"A") is None and pool.lookup(b"B") == b
    pool.touch([b])  # a cache hit revives a free block
    assert pool.allocate(1) == [c] and pool.num_free == 0


def test_cache_hit_leaves_at_least_one_token_to_compute() -> None:
    kv = KVCacheCoordinator.paged_only(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    assert kv.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    kv.register_computed_blocks(first)
    kv.free(first)
    # Same 8 tokens: both blocks are cached, but only the first may be used.
    again = make_request("b", list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1
    longer = make_request("c", list(range(9)))
    assert len(kv.find_cached_prefix(longer)) == 2
    salted = make_request("d", list(range(9)), salt="other")
    assert kv.find_cached_prefix(salted) == []


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheCoordinator.paged_only(num_blocks=2, block_size=4, enable_prefix_caching=False)
    request = make_request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert kv.pool.num_free == 2 and "a" not in kv.block_tables

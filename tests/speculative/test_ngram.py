"""The n-gram (prompt lookup) proposer: exact proposals, a brute-force reference, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.speculative.ngram import NgramProposer


def reference(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix first, then the most recent earlier occurrence; what followed it."""
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


@pytest.mark.parametrize(("ids", "k", "min_n", "max_n", "expected"), [
    # the longest match wins over a more recent shorter one: "1 2 3" matched at 0, "3" alone at 5
    ([1, 2, 3, 7, 8, 3, 9, 1, 2, 3], 2, 1, 4, [7, 8]),
    # among equally long matches the most recent one wins
    ([5, 6, 1, 5, 6, 2, 5, 6], 1, 1, 2, [2]),
    ([5, 6, 1, 5, 6, 2, 5, 6], 3, 1, 2, [2, 5, 6]),
    # min_n: only 1-token suffixes match, so min_n=2 proposes nothing
    ([1, 2, 3, 4, 1], 3, 1, 4, [2, 3, 4]),
    ([1, 2, 3, 4, 1], 3, 2, 4, []),
    # no earlier occurrence of the last token
    ([1, 2, 3, 4, 5], 4, 1, 4, []),
    # k caps the proposal
    ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 3, 1, 4, [3, 4, 5]),
    # near the end fewer than k tokens follow the most recent match
    ([9, 4, 4, 9], 4, 1, 4, [4, 4, 9]),
    ([1, 2, 1, 2], 5, 1, 4, [1, 2]),
    # max_n bounds the matched suffix: with max_n=1 the most recent "3" wins, not the longer match
    ([1, 2, 3, 7, 8, 3, 9, 1, 2, 3], 2, 1, 1, [9, 1]),
    # overlapping with the suffix itself is allowed (a run of one token)
    ([4, 4, 4, 4], 3, 1, 3, [4]),
    # too short to match anything
    ([7], 4, 1, 4, []),
    ([], 4, 1, 4, []),
])
def test_exact_proposals(ids: list[int], k: int, min_n: int, max_n: int, expected: list[int]) -> None:
    proposer = NgramProposer(k, min_n=min_n, max_n=max_n)
    assert reference(ids, k, min_n, max_n) == expected  # the reference agrees with the hand answer
    assert proposer.propose(ids) == expected
    assert proposer.propose(np.asarray(ids, dtype=np.int64)) == expected
    assert proposer.propose_request("r", ids) == expected


def test_max_tokens_caps_below_k_and_batch() -> None:
    proposer = NgramProposer(4)
    ids = [1, 2, 3, 4, 5, 6, 1]
    assert proposer.propose(ids, max_tokens=2) == [2, 3]
    assert proposer.propose(ids, max_tokens=0) == []
    rows = [ids, [1, 2, 3], [8, 9, 8]]
    assert proposer.propose_batch(rows) == [[2, 3, 4, 5], [], [9, 8]]
    assert proposer.propose_batch(rows, max_tokens=[1, None, 1]) == [[2], [], [9]]
    assert proposer.propose_batch(rows, max_tokens=1, request_ids=["a", "b", "c"]) == [[2], [], [9]]
    assert proposer.num_cached_requests == 3
    with pytest.raises(ValueError):
        proposer.propose_batch(rows, max_tokens=[1])
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(4, min_n=3, max_n=2)


def test_request_cache_follows_growth_and_rebuilds_otherwise() -> None:
    proposer = NgramProposer(3, max_n=3)
    ids = [3, 1, 4, 1, 5]
    assert proposer.propose_request("r", ids) == reference(ids, 3, 1, 3)
    for step, token in enumerate([9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 0] * 40):  # past capacity
        ids.append(token)
        got = proposer.propose_request("r", ids)
        if step % 37 == 0:
            assert got == reference(ids, 3, 1, 3)
    other = [7, 7, 1, 7, 7]  # not an extension: rebuilt, not mixed with the old ids
    assert proposer.propose_request("r", other) == reference(other, 3, 1, 3)
    shorter = ids[:10]
    assert proposer.propose_request("r", shorter) == reference(shorter, 3, 1, 3)
    proposer.remove_request("r")
    proposer.remove_request("never-seen")
    assert proposer.num_cached_requests == 0


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 5), max_size=60),
    k=st.integers(1, 6), min_n=st.integers(1, 4), extra=st.integers(0, 3),
)
def test_matches_brute_force(ids: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    proposer = NgramProposer(k, min_n=min_n, max_n=max_n)
    assert proposer.propose(ids) == reference(ids, k, min_n, max_n)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=12))
def test_incremental_matches_stateless(steps: list[list[int]]) -> None:
    proposer = NgramProposer(4, min_n=1, max_n=3)
    ids: list[int] = []
    for new in steps:
        ids += new
        assert proposer.propose_request(0, ids) == reference(ids, 4, 1, 3)


def test_speed_32k_context() -> None:
    """Prints timings; asserts only the answers (a shared CPU makes times noisy)."""
    rng = np.random.default_rng(0)
    text = rng.integers(0, 50_000, 2_000)
    ids = np.concatenate([rng.integers(0, 50_000, 30_000), text[:1_500], text[:700]]).tolist()
    ids = ids[:32_768]
    proposer = NgramProposer(4, min_n=1, max_n=4)
    expected = text[700:704].tolist()
    arr = np.asarray(ids, dtype=np.int64)
    worst = np.zeros(32_768, dtype=np.int64)  # every position matches: the most candidates
    timings = {}
    for name, fn in {
        "array": lambda: proposer.propose(arr),
        "list": lambda: proposer.propose(ids),
        "cached": lambda: proposer.propose_request("bench", ids),
        "all-equal": lambda: proposer.propose(worst),
    }.items():
        fn()
        start = time.perf_counter()
        for _ in range(50):
            out = fn()
        timings[name] = (time.perf_counter() - start) / 50 * 1e3
        assert out == ([0] if name == "all-equal" else expected)  # most recent: ends one before the end
    # a decode loop: one new token per step through the per-request cache
    growing = ids[:30_000]
    start = time.perf_counter()
    for token in ids[30_000:30_200]:
        growing.append(token)
        proposer.propose_request("decode", growing)
    timings["decode step"] = (time.perf_counter() - start) / 200 * 1e3
    print("ngram propose on a 32k context (ms/call): " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()))

"""N-gram (prompt lookup) proposer: find the longest suffix of the context that occurred earlier
and propose the tokens that followed its most recent earlier occurrence.

The drafts are deterministic, so their q is one-hot and verification stays exact.

Search: every earlier position `e` whose token equals the last token is a candidate end of a
match; candidates are then extended backwards one token at a time (vectorised over the surviving
candidates only), so one call costs one pass over the context plus work proportional to the
number of partial matches. Converting a Python list of 32k ids to an array costs more than the
search itself, so `propose_request` keeps each request's ids in a growing array and appends only
what is new since the last step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

_DTYPE = np.int64


class _TokenBuffer:
    """A request's token ids in an array that grows by doubling (append-only, may truncate)."""

    __slots__ = ("data", "size")

    def __init__(self, capacity: int = 1024) -> None:
        self.data = np.empty(max(capacity, 16), dtype=_DTYPE)
        self.size = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """Brings the buffer up to `token_ids` (which normally only grew) and returns its view."""
        n = len(token_ids)
        if n < self.size or (self.size and int(token_ids[self.size - 1]) != int(self.data[self.size - 1])):
            self.size = 0  # not an extension of what we hold: start over
        if n > self.size:
            if n > len(self.data):
                grown = np.empty(max(n, 2 * len(self.data)), dtype=_DTYPE)
                grown[: self.size] = self.data[: self.size]
                self.data = grown
            new = token_ids[self.size:]
            self.data[self.size:n] = new if isinstance(new, np.ndarray) else np.fromiter(new, _DTYPE, n - self.size)
            self.size = n
        return self.data[:n]


class NgramProposer:
    """Prompt-lookup drafts: up to `num_speculative_tokens` tokens per call.

    `min_n`/`max_n` bound the length of the suffix that must match; a longer match is always
    preferred, and among matches of one length the most recent earlier occurrence wins."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._buffers: dict[Hashable, _TokenBuffer] = {}

    # ------------------------------------------------------------------ stateless

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Drafts for one context (a list, or an int array to skip the conversion).
        `max_tokens` caps the count below k (e.g. the room left before max_tokens)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ids = token_ids if isinstance(token_ids, np.ndarray) else np.fromiter(token_ids, _DTYPE, len(token_ids))
        return self._search(ids, k)

    def propose_batch(
        self, batch: Sequence[Sequence[int] | np.ndarray], max_tokens: int | Sequence[int | None] | None = None,
        request_ids: Sequence[Hashable] | None = None,
    ) -> list[list[int]]:
        """Drafts per row; `max_tokens` is one cap or one per row. With `request_ids`, each row
        uses that request's cached array (see `propose_request`)."""
        caps = max_tokens if isinstance(max_tokens, Sequence) else [max_tokens] * len(batch)
        if len(caps) != len(batch) or (request_ids is not None and len(request_ids) != len(batch)):
            raise ValueError("max_tokens and request_ids need one entry per row")
        if request_ids is None:
            return [self.propose(row, cap) for row, cap in zip(batch, caps)]
        return [self.propose_request(rid, row, cap) for rid, row, cap in zip(request_ids, batch, caps)]

    # ------------------------------------------------------------------ per-request state

    def propose_request(self, request_id: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Like `propose`, but keeps the request's ids as an array between calls, so a decode
        step converts only the new tokens. `token_ids` are the verified ids (prompt + output);
        anything that is not an extension of the previous call is rebuilt from scratch."""
        buffer = self._buffers.get(request_id)
        if buffer is None:
            buffer = self._buffers[request_id] = _TokenBuffer(2 * len(token_ids))
        return self.propose(buffer.sync(token_ids), max_tokens)

    def remove_request(self, request_id: Hashable) -> None:
        """Drops a finished (or aborted) request's cached ids."""
        self._buffers.pop(request_id, None)

    @property
    def num_cached_requests(self) -> int:
        return len(self._buffers)

    # ------------------------------------------------------------------ search

    def _search(self, ids: np.ndarray, k: int) -> list[int]:
        length = len(ids)
        # cand: end positions e <= length - 2 with ids[e] == ids[-1] (matches of length 1)
        cand = np.flatnonzero(ids[: length - 1] == ids[length - 1])
        best_end, best_len = -1, 0
        n = 1
        while cand.size:
            best_end, best_len = int(cand[-1]), n  # most recent candidate of the longest length so far
            if n == self.max_n:
                break
            # extend every surviving match one token further back: needs ids[e - n] == ids[-1 - n]
            cand = cand[cand >= n]
            cand = cand[ids[cand - n] == ids[length - 1 - n]]
            n += 1
        if best_len < self.min_n:
            return []
        return ids[best_end + 1: best_end + 1 + k].tolist()

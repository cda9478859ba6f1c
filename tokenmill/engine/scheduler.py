"""The scheduler: one rule, under a per-step budget.

Every request's `num_computed_tokens` catches up with its `num_tokens`. Running requests go
first (a decode is one token, an unfinished prefill a chunk of what is left), then waiting
requests are admitted in queue order while budget, sequence slots and KV blocks last. When a
running request cannot get a block, the least important running request is preempted: its
blocks are freed and it is recomputed later (its computed prefix usually survives in the
prefix cache). Chunked prefill, mixed prefill/decode batches and prefix hits all follow.

The budget (SchedulerConfig): a step in which some request decodes holds max_num_batched_tokens
tokens and as much cost, a step of prompt chunks alone long_prefill_batched_tokens. A chunk's
cost grows with the depth its keys start at (prefill_attention_depth), so chunks at depth are
smaller and a step beside running decodes stays about as long at 260k as at 0; decodes are never
cut, and a prefill gets at least one block's tokens a step, so it always progresses.

Admission: a waiting request is admitted only when the KV blocks of its whole prompt are free
now, beside one spare block per running request (the next block each decode may need), and
those blocks are allocated at once. A prefill in progress so never needs a block; only growing
decodes can preempt, and a preempted request returns only when its whole prompt fits again,
so preemption cannot cycle on a long prompt. A request alone always fits (the cache holds
max_model_len tokens: plan_caches fails at start-up otherwise), so nothing waits forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.engine.queues import QUEUE_POLICIES, RequestQueue, priority_key
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.coordinator import KVCacheCoordinator


@dataclass
class ScheduledBatch:
    """What one step computes: each request with its number of new tokens, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)

    def remove(self, request: Request) -> int:
        i = self.requests.index(request)
        self.requests.pop(i)
        return self.num_new_tokens.pop(i)

    def sampling_requests(self) -> list[Request]:
        """Requests whose step computes their last token (and drafts), so their next token is sampled."""
        return [
            r for r, n in zip(self.requests, self.num_new_tokens) if r.num_computed_tokens + n == r.num_tokens_with_drafts
        ]


@dataclass
class StepBudget:
    """What is left of one step's budget: tokens, and cost (tokens weighted by the depth their keys
    start at: `cost`)."""

    tokens: int
    cost: float
    depth: int  # prefill_attention_depth; 0 = cost is tokens

    def cost_of(self, n: int, start: int) -> float:
        """A chunk of n tokens at positions start.. (a decode: n = 1)."""
        return float(n) if not self.depth else n * (1.0 + (start + n / 2) / self.depth)

    def chunk(self, remaining: int, start: int, floor: int) -> int:
        """The most tokens (of `remaining`) a prefill at `start` may take: within the tokens and the
        cost left, but at least `floor` while tokens last."""
        n = min(remaining, self.tokens)
        if self.depth and self.cost_of(n, start) > self.cost:
            # n^2 / (2D) + n (1 + start / D) <= cost, for the largest n.
            b = 1.0 + start / self.depth
            n = min(n, int(self.depth * (math.sqrt(b * b + 2.0 * max(self.cost, 0.0) / self.depth) - b)))
        return max(n, min(floor, remaining, self.tokens))

    def take(self, n: int, start: int) -> None:
        self.tokens -= n
        self.cost -= self.cost_of(n, start)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheCoordinator) -> None:
        self.config = config
        self.kv = kv
        self.waiting: RequestQueue = QUEUE_POLICIES[config.policy]()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.push(request)

    def abort(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        self.kv.free(request, keep_snapshots=False)
        request.finish("abort")

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def budget(self) -> StepBudget:
        """This step's budget: the decode-latency one while a running request decodes, else the
        long-prefill one."""
        config = self.config
        decoding = any(not r.reached_max_tokens and r.num_tokens - r.num_computed_tokens <= 1 for r in self.running)
        tokens = config.max_num_batched_tokens
        if not decoding and config.long_prefill_batched_tokens is not None:
            tokens = config.long_prefill_batched_tokens
        return StepBudget(tokens, float(tokens), config.prefill_attention_depth or 0)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget()
        floor = self.kv.block_size

        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            if request.reached_max_tokens:  # its last token is in flight; it ends when resolved
                i += 1
                continue
            start = request.num_computed_tokens
            if request.num_tokens - start > 1:  # a prefill (or a recompute): a chunk at its depth
                n = budget.chunk(request.num_tokens - start, start, floor)
                request.drop_drafts()
            else:  # a decode, with its drafts if the tokens allow: never cut by cost
                n = min(request.num_tokens_with_drafts - start, budget.tokens)
                if n < request.num_tokens_with_drafts - start:
                    request.drop_drafts()  # drafts are verified whole or not at all
                    n = min(request.num_tokens - start, budget.tokens)
            while not self.kv.allocate_slots(request, n):
                victim = self._pick_victim()
                if victim in batch.requests:
                    budget.tokens += batch.remove(victim)  # its cost is not given back: a bound, not a sum
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.add(request, n)
                budget.take(n, start)
                i += 1

        if batch.preempted:
            return batch
        while len(self.waiting) and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            n = budget.chunk(remaining, num_cached_tokens, floor)
            # The whole prompt's blocks now, beside a spare block per running request (see the module doc).
            if not self.kv.allocate_slots(request, remaining, cached, reserve=len(self.running)):
                break
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, n)
            budget.take(n, num_cached_tokens)
        return batch

    def finish_step(self, batch: ScheduledBatch) -> list[Request]:
        """Count the step's tokens as computed (it has been launched) and give each sampling
        request a placeholder for the token it will get. Returns the sampling requests."""
        sampling = batch.sampling_requests()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.kv.register_computed_blocks(request)
        for request in sampling:
            request.num_placeholders += 1
        return sampling

    def release(self, request: Request) -> None:
        """Drop a request that just finished."""
        self.running.remove(request)
        self.kv.free(request)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.drop_drafts()
        request.draft_num_computed = 0
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.push_front(request)
        self.num_preemptions += 1

"""The scheduler: one rule, under a per-step token budget.

Every request's `num_computed_tokens` catches up with its `num_tokens`. Running requests go
first (a decode is one token, an unfinished prefill a chunk of what is left), then waiting
requests are admitted in queue order while budget, sequence slots and KV blocks last. When a
running request cannot get a block, the least important running request is preempted: its
blocks are freed and it is recomputed later (its computed prefix usually survives in the
prefix cache). Chunked prefill, mixed prefill/decode batches and prefix hits all follow.
"""

from __future__ import annotations

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

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.reached_max_tokens:  # its last token is in flight; it ends when resolved
                i += 1
                continue
            n = min(request.num_tokens_with_drafts - request.num_computed_tokens, budget)
            if n < request.num_tokens_with_drafts - request.num_computed_tokens:
                request.drop_drafts()  # drafts are verified whole or not at all
                n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                victim = self._pick_victim()
                if victim in batch.requests:
                    budget += batch.remove(victim)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.add(request, n)
                budget -= n
                i += 1

        if batch.preempted:
            return batch
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            n = min(request.num_tokens - num_cached_tokens, budget)
            if not self.kv.allocate_slots(request, n, cached):
                break
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.add(request, n)
            budget -= n
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

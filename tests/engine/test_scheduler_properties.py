"""Property tests of the scheduler and block allocator, with a simulated model.

The simulation writes, for every computed position, which token prefix the KV slot holds, and
checks before every step that each scheduled request reads exactly its own prefix — so prefix
hits, preemption and block reuse are checked for correctness, not only for leaks.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.sampling_params import SamplingParams


class Simulation:
    def __init__(
        self, num_blocks: int, block_size: int, budget: int, max_seqs: int, policy: str, caching: bool, seed: int
    ) -> None:
        self.kv = KVCacheCoordinator.paged_only(num_blocks, block_size, caching)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy), self.kv)
        self.rng = random.Random(seed)
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.live: dict[str, Request] = {}
        self.done: set[str] = set()
        self.count = 0

    def arrive(self, prompt_len: int, max_tokens: int, priority: int, shared: bool) -> None:
        # Shared prompts start with the same tokens, so the prefix cache gets hits.
        head = [7] * (prompt_len - 1) if shared else []
        prompt = head + [self.rng.randrange(50) for _ in range(prompt_len - len(head))]
        request = Request(
            request_id=str(self.count), prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens),
            eos_token_ids=frozenset(), max_tokens=max_tokens, priority=priority, arrival_index=self.count,
            cache_salt="b" if self.count % 5 == 0 else None,
        )
        self.count += 1
        self.live[request.request_id] = request
        self.scheduler.add(request)

    def abort_random(self) -> None:
        if self.live:
            request = self.live.pop(self.rng.choice(sorted(self.live)))
            self.scheduler.abort(request)
            self.done.add(request.request_id)

    def step(self) -> None:
        batch = self.scheduler.schedule()
        bs = self.kv.block_size
        for request, n in zip(batch.requests, batch.num_new_tokens):
            assert n >= 1
            table = self.kv.block_tables[request.request_id]
            tokens = request.all_token_ids
            start = request.num_computed_tokens
            assert len(table) * bs >= start + n
            for p in range(start):  # what attention will read must be this request's own prefix
                assert self.slots.get((table[p // bs], p % bs)) == (request.cache_salt, *tokens[: p + 1])
            for p in range(start, start + n):
                self.slots[(table[p // bs], p % bs)] = (request.cache_salt, *tokens[: p + 1])
        for request in self.scheduler.finish_step(batch):
            request.num_placeholders -= 1
            request.append_output(self.rng.randrange(50))
            request.check_stop_token()
            if request.is_finished:
                self.scheduler.release(request)
                del self.live[request.request_id]
                self.done.add(request.request_id)
        self.check_invariants()

    def check_invariants(self) -> None:
        pool = self.kv.pool
        refs = Counter(b for table in self.kv.block_tables.values() for b in table)
        for block in range(pool.num_blocks):
            assert pool.ref_counts[block] == refs.get(block, 0), f"block {block} ref count"
            assert (block in pool.free_queue) == (refs.get(block, 0) == 0)
        for block_hash, block in pool.cached.items():
            assert pool.block_hash[block] == block_hash
        running = {r.request_id for r in self.scheduler.running}
        assert set(self.kv.block_tables) == running
        assert len(running) <= self.scheduler.config.max_num_seqs
        for request in self.scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    events=st.lists(
        st.tuples(st.sampled_from(["arrive", "step", "step", "abort"]), st.integers(1, 40), st.integers(1, 12),
                  st.integers(-2, 2), st.booleans()),
        min_size=1, max_size=60,
    ),
)
def test_random_traffic_never_leaks_and_always_finishes(seed, block_size, budget, max_seqs, policy, caching, events) -> None:
    max_len = 52  # longest prompt (40) + answer (12)
    num_blocks = -(-max_len // block_size) + random.Random(seed).randrange(0, 12)
    sim = Simulation(num_blocks, block_size, budget, max_seqs, policy, caching, seed)
    for kind, length, max_tokens, priority, shared in events:
        if kind == "arrive":
            sim.arrive(length, max_tokens, priority, shared)
        elif kind == "abort":
            sim.abort_random()
        else:
            sim.step()
    for _ in range(10_000):
        if not sim.scheduler.has_unfinished():
            break
        sim.step()
    assert not sim.live, "every request finishes or is aborted"
    assert sim.done == {str(i) for i in range(sim.count)}
    assert sim.kv.pool.num_used == 0 and not sim.kv.block_tables


def test_priority_policy_admits_lower_value_first() -> None:
    sim = Simulation(num_blocks=64, block_size=4, budget=1000, max_seqs=1, policy="priority", caching=False, seed=0)
    for priority in (3, -1, 2):
        sim.arrive(prompt_len=5, max_tokens=1, priority=priority, shared=False)
    finished_order = []
    while sim.scheduler.has_unfinished():
        before = set(sim.live)
        sim.step()
        finished_order += sorted(before - set(sim.live))
    assert finished_order == ["1", "2", "0"]

"""Memory that never surprises, on the scheduler and the block pool alone (tiny KV budgets): a
request is admitted only when its whole prompt's blocks are free beside one spare block per
running request, the rest queue; a prefill in progress is never preempted by its own chunks;
preemption ends (long prompts do not cycle); every block comes back. And the step-cost rule:
chunks shrink with depth within the budget, decodes beside them run every step."""

from __future__ import annotations

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, StepBudget
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.sampling_params import SamplingParams


class Engine:
    """The scheduler stepped as the engine steps it, with a model that samples token 1."""

    def __init__(self, num_blocks: int, block_size: int = 4, budget: int = 32, depth: int = 0,
                 long_budget: int | None = None, max_seqs: int = 8) -> None:
        self.kv = KVCacheCoordinator.paged_only(num_blocks, block_size, enable_prefix_caching=False)
        config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, prefill_attention_depth=depth,
                                 long_prefill_batched_tokens=long_budget)
        self.scheduler = Scheduler(config, self.kv)
        self.steps: list[list[tuple[str, int, int]]] = []  # per step: (request, start, tokens)
        self.preempted: list[str] = []

    def add(self, name: str, prompt_len: int, max_tokens: int) -> Request:
        request = Request(request_id=name, prompt_token_ids=[2] * prompt_len, params=SamplingParams(max_tokens=max_tokens),
                          eos_token_ids=frozenset(), max_tokens=max_tokens)
        self.scheduler.add(request)
        return request

    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.preempted += [r.request_id for r in batch.preempted]
        self.steps.append([(r.request_id, r.num_computed_tokens, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        for request in self.scheduler.finish_step(batch):
            request.num_placeholders -= 1
            request.append_output(1)
            request.check_stop_token()
            if request.is_finished:
                self.scheduler.release(request)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps")


def test_a_long_prompt_waits_until_its_whole_prompt_fits_then_runs_unpreempted() -> None:
    engine = Engine(num_blocks=28, block_size=4, budget=8)  # 112 tokens of KV
    short = engine.add("short", 8, 40)  # 3 blocks now, 12 at its end
    engine.step()
    long = engine.add("long", 100, 4)  # 25 blocks, and a spare for short: 26 > the 25 free
    engine.step()
    assert list(engine.scheduler.waiting) == [long]  # the old rule admitted its first 8-token chunk here
    while list(engine.scheduler.waiting):
        engine.step()
    assert short.is_finished  # it waited for short's blocks
    assert len(engine.kv.block_tables["long"]) == 25  # its whole prompt at once
    assert engine.steps[-1] == [("long", 0, 8)]  # computed in chunks of the budget
    engine.run()
    assert "long" not in engine.preempted and short.is_finished and long.is_finished
    assert engine.kv.pool.num_used == 0 and not engine.kv.block_tables


def test_preemption_ends_and_nothing_leaks_under_tight_memory() -> None:
    """Long and short requests whose answers grow until memory runs out: some are preempted and
    recomputed, none cycles, all finish, every block comes back."""
    engine = Engine(num_blocks=40, block_size=4, budget=16)  # 160 tokens of KV
    for i in range(6):
        engine.add(f"long{i}", 90, 30)  # 120 tokens each at the end
        engine.add(f"short{i}", 6, 60)
    engine.run()
    assert engine.kv.pool.num_used == 0 and not engine.kv.block_tables
    assert engine.scheduler.num_preemptions == len(engine.preempted)
    counts = {name: engine.preempted.count(name) for name in set(engine.preempted)}
    assert engine.preempted and all(count <= 2 for count in counts.values()), counts
    # Preemption only ever followed a decode's growth: no request was preempted while prefilling.
    for name in engine.preempted:
        assert name.startswith(("long", "short"))
    assert len(engine.steps) < 2_000


def test_a_request_that_fills_the_cache_alone_still_runs() -> None:
    engine = Engine(num_blocks=10, block_size=4, budget=64)  # exactly the 40 tokens of max_model_len
    first = engine.add("a", 20, 20)
    second = engine.add("b", 20, 20)
    engine.run()
    assert first.is_finished and second.is_finished and len(second.output_token_ids) == 20
    assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize("depth", [64, 1000])
def test_chunks_shrink_with_depth_within_the_cost_budget(depth: int) -> None:
    budget = StepBudget(tokens=256, cost=256.0, depth=depth)
    sizes = [budget.chunk(10_000, start, floor=4) for start in (0, 1_000, 10_000, 100_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] >= 4
    for start, n in zip((0, 1_000, 10_000, 100_000), sizes):
        assert budget.cost_of(n, start) <= 256 or n == 4
        assert n == 256 or budget.cost_of(n + 1, start) > 256  # the largest that fits
    assert StepBudget(tokens=256, cost=256.0, depth=0).chunk(10_000, 100_000, floor=4) == 256  # tokens only


def test_decodes_beside_a_deep_prefill_run_every_step_and_steps_stay_bounded() -> None:
    engine = Engine(num_blocks=1200, block_size=16, budget=64, depth=256, max_seqs=4)
    engine.add("stream", 4, 200)
    engine.step()
    engine.add("long", 4000, 1)
    engine.run()
    long_steps = [s for s in engine.steps if any(name == "long" for name, _, _ in s)]
    assert len(long_steps) > 4000 // 64  # chunks shrank at depth
    cost = StepBudget(64, 64.0, 256)
    for step in long_steps:
        spent = sum(cost.cost_of(n, start) for _, start, n in step)
        start, chunk = next((start, n) for name, start, n in step if name == "long")
        assert spent <= 64 + 1e-9 or chunk == min(16, 4000 - start)  # within the budget, or the one-block floor
    stream_steps = [i for i, s in enumerate(engine.steps) if any(name == "stream" for name, _, _ in s)]
    assert stream_steps == list(range(len(stream_steps)))  # the stream decoded in every step until it ended


def test_a_prefill_alone_takes_the_long_prefill_budget() -> None:
    engine = Engine(num_blocks=300, block_size=16, budget=64, long_budget=512)
    engine.add("long", 2000, 1)
    engine.step()
    assert engine.steps[-1] == [("long", 0, 512)]
    engine.run()
    engine.add("stream", 4, 50)
    engine.step()
    engine.add("long2", 2000, 1)
    engine.step()  # the stream decodes: the decode-latency budget
    assert [(name, n) for name, _, n in engine.steps[-1]] == [("stream", 1), ("long2", 63)]


# ---- through the engine, on a tiny model with a cache of exactly max_model_len tokens


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    from tiny_models import save_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


def tight_llm(path, blocks: int, max_model_len: int = 64, **overrides):
    from tokenmill import LLM

    roomy = LLM(str(path), device="cpu", dtype="float32", max_model_len=max_model_len, block_size=4)
    per_block = roomy.engine.runner.cache_plan.bytes_per_block
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=max_model_len, block_size=4,
               kv_cache_bytes=blocks * per_block, **overrides)


def test_the_engine_queues_what_does_not_fit_refuses_what_never_can_and_leaks_nothing(tiny_llama) -> None:
    from tokenmill.errors import InvalidRequestError

    llm = tight_llm(tiny_llama, blocks=16, max_num_batched_tokens=12)  # 64 tokens: one longest request
    assert llm.engine.kv.num_blocks == 16
    prompts = [[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate((40, 9, 33, 5, 50, 17))]
    params = [SamplingParams(temperature=0, max_tokens=64 - len(p) - i % 3, ignore_eos=True) for i, p in enumerate(prompts)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    with pytest.raises(InvalidRequestError, match=r"max_tokens 30 plus the prompt's 40 tokens exceeds the context of 64"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequestError, match=r"the prompt has 64 tokens but the context is 64 tokens"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=1))
    assert llm.engine.stats().kv_blocks_used == 0


def test_a_cache_smaller_than_one_request_is_refused_at_start_up(tiny_llama) -> None:
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the KV cache holds 60 tokens but --max-model-len is 64: one request could never fit"):
        tight_llm(tiny_llama, blocks=15)

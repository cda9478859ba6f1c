"""Hybrid prefix caching at small granularity: attention KV in blocks of 8 tokens, the recurrent
state snapshotted every 32 tokens and at each prompt's last full block. Follow-ups sharing a
prefix of any length resume from the deepest snapshot at or below the paged hit and give the
greedy answer of an engine without a prefix cache; a snapshot pool of two slots evicts and stays
exact; the pool's bytes come out of the cache budget; the hit counts reach the engine's stats,
the Prometheus metrics and each request's cached tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybrid_models import hybrid_llm, random_prompts, save_hybrid

from tokenmill import LLM, SamplingParams
from tokenmill.server.metrics import ServerMetrics

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BASE = random_prompts((100,), seed=21)[0]
FRESH = random_prompts((40,), seed=22)[0]
# (shared prefix length, new tokens after it) -> the cached tokens expected: the deepest snapshot
# (32, 64, 96: the interval; 96: the base prompt's last full block) within the paged hit.
FOLLOW_UPS = {(37, 10): 32, (61, 12): 32, (99, 3): 96, (100, 5): 96, (20, 30): 0, (70, 1): 64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    save_hybrid("qwen3_5_moe", path)
    return path


def prefix_llm(path: Path, **overrides: object) -> LLM:
    """Snapshots every 32 tokens, steps of 32 tokens."""
    return hybrid_llm(path, **{**dict(mamba_state_interval=32, max_num_batched_tokens=32), **overrides})


def follow_up(shared: int, new: int) -> list[int]:
    return BASE[:shared] + FRESH[:new]


def answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def uncached(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    prompts = [BASE, FRESH] + [follow_up(*key) for key in FOLLOW_UPS]
    llm = prefix_llm(model_dir, enable_prefix_caching=False)
    assert llm.engine.kv.snapshots is None
    return {tuple(p): a for p, a in zip(prompts, answers(llm, prompts))}


def test_unaligned_prefix_hits_resume_the_deepest_snapshot(model_dir: Path, uncached) -> None:
    llm = prefix_llm(model_dir)
    assert answers(llm, [BASE]) == [uncached[tuple(BASE)]]
    for (shared, new), expected_cached in FOLLOW_UPS.items():
        prompt = follow_up(shared, new)
        out = llm.generate([prompt], PARAMS)[0]
        assert out.outputs[0].token_ids == uncached[tuple(prompt)], (shared, new)
        assert out.num_cached_tokens == expected_cached, (shared, new)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == sum(FOLLOW_UPS.values())
    assert stats.prefix_cache_paged_hits > stats.prefix_cache_hits  # e.g. 61 shared: 56 in paged blocks, 32 resumed
    assert stats.state_snapshot_hits == sum(1 for v in FOLLOW_UPS.values() if v)
    assert 0 < stats.state_snapshot_bytes_used <= stats.state_snapshot_bytes_total
    metrics = ServerMetrics("hybrid")
    metrics.set_engine_stats(stats)
    text = metrics.render().decode()
    assert f'tokenmill:state_snapshot_hits_total{{model_name="hybrid"}} {float(stats.state_snapshot_hits)}' in text
    assert "tokenmill:prefix_cache_paged_hits_total" in text


def test_batched_follow_ups_and_a_tiny_snapshot_pool_stay_exact(model_dir: Path, uncached) -> None:
    """Two snapshot slots for everything: snapshots evicted least recently used while requests run
    in one batch (chunked, resumed from whatever survived, async scheduling: decode boundaries are
    placeholders when their snapshot is taken); the answers are the uncached ones."""
    probe = prefix_llm(model_dir)
    per_slot = probe.engine.kv.bytes_per_state_slot
    llm = prefix_llm(model_dir, mamba_snapshot_bytes=2 * per_slot, async_scheduling=True)
    assert llm.engine.async_scheduling
    kv = llm.engine.kv
    assert kv.snapshots.num_slots == 2
    prompts = [BASE, FRESH] + [follow_up(*key) for key in FOLLOW_UPS]
    for _ in range(2):
        assert answers(llm, prompts) == [uncached[tuple(p)] for p in prompts]
    assert kv.snapshots.counters.evicted > 0 and kv.snapshots.num_cached <= 2
    assert llm.engine.stats().state_snapshot_bytes_total == 2 * per_slot
    assert kv.state.num_free == kv.state.num_slots and kv.pool.num_used == 0
    plan = llm.engine.runner.cache_plan  # no snapshot slot is lost
    assert sorted(kv.snapshots.free_slots + list(kv.snapshots.cached.values())) == list(
        range(plan.first_snapshot_slot, plan.scratch_slot))


def test_snapshot_pool_bytes_come_out_of_the_cache_budget(model_dir: Path) -> None:
    plans = {name: prefix_llm(model_dir, **kw).engine.runner.cache_plan for name, kw in {
        "default": {}, "none": {"mamba_snapshot_bytes": 0}, "no-prefix-cache": {"enable_prefix_caching": False},
        "bf16": {"mamba_ssm_cache_dtype": "bfloat16"}}.items()}
    default, none = plans["default"], plans["none"]
    budget = 1 << 22
    assert default.snapshot_bytes <= budget // 4 < default.snapshot_bytes + default.bytes_per_state_slot
    assert none.num_snapshot_slots == plans["no-prefix-cache"].num_snapshot_slots == 0
    state = (default.num_state_slots + 1) * default.bytes_per_state_slot
    assert default.num_blocks == (budget - state - default.snapshot_bytes) // default.bytes_per_block
    assert none.num_blocks == (budget - state) // none.bytes_per_block
    assert plans["bf16"].bytes_per_state_slot < default.bytes_per_state_slot
    assert plans["bf16"].num_snapshot_slots > default.num_snapshot_slots

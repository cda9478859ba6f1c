"""Recurrent state as a cache kind: its bytes per slot (the state dtype flag halves the delta
state), the plan's slots for running requests (spares with speculation) and snapshots, spare
slots re-pointed on rollback, and snapshots at interval and prompt-end boundaries, published once
computed, matched by chained block hashes (and salt), evicted least recently used."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import HYBRID_CONFIGS

from tokenmill.engine.request import Request
from tokenmill.errors import ConfigError
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.kv.planner import CachePlan, plan_caches
from tokenmill.kv.specs import FullAttentionSpec, RecurrentStateSpec, StateTensor
from tokenmill.kv.state import NO_CHECKPOINT, StateSlotManager
from tokenmill.layers.linear_attention import GatedDeltaNet
from tokenmill.quantization import Unquantized
from tokenmill.sampling_params import SamplingParams


def gdn_spec(state_dtype: torch.dtype) -> RecurrentStateSpec:
    layer = GatedDeltaNet(HYBRID_CONFIGS["qwen3_next"], "layer", Unquantized(), grouped_projections=True,
                          state_dtype=state_dtype)
    return layer.cache_spec()


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, params=SamplingParams(), eos_token_ids=frozenset(),
                   max_tokens=4, cache_salt=salt)


def test_slot_bytes_follow_the_state_dtype() -> None:
    conv = 3 * (2 * 16 + 32) * 4  # (kernel - 1) x (q | k | v channels), float32 model
    assert gdn_spec(torch.float32).bytes_per_slot() == conv + 4 * 8 * 8 * 4  # value heads x d_k x d_v
    assert gdn_spec(torch.bfloat16).bytes_per_slot() == conv + 4 * 8 * 8 * 2
    assert {t.dtype for t in gdn_spec(torch.bfloat16).tensors} == {torch.float32, torch.bfloat16}


def test_plan_counts_request_slots_spares_and_snapshots_in_bytes() -> None:
    specs = {"gdn0": gdn_spec(torch.bfloat16), "gdn1": gdn_spec(torch.bfloat16),
             "attn": FullAttentionSpec(8, torch.float32, 2, 16)}
    per_slot, per_block = 2 * gdn_spec(torch.bfloat16).bytes_per_slot(), 2 * 8 * 2 * 16 * 4
    budget = 1 << 20
    plan = plan_caches(specs, budget, 8, 256, max_num_seqs=4, state_slots_per_seq=1 + 3, snapshot_bytes=10 * per_slot)
    assert (plan.num_state_slots, plan.num_snapshot_slots, plan.bytes_per_state_slot) == (16, 10, per_slot)
    assert plan.scratch_slot == 26 and plan.snapshot_bytes == 10 * per_slot
    assert plan.num_blocks == (budget - 27 * per_slot) // per_block
    quarter = plan_caches(specs, budget, 8, 256, max_num_seqs=4, snapshot_bytes=None)
    assert quarter.num_snapshot_slots == budget // 4 // per_slot


def test_speculation_needs_layers_that_write_checkpoints() -> None:
    silent = RecurrentStateSpec((StateTensor("s", (4,), torch.float32),))
    with pytest.raises(ConfigError, match="keep no checkpoints"):
        plan_caches({"s": silent}, 1 << 20, 8, 64, max_num_seqs=2, state_slots_per_seq=3)
    assert plan_caches({"s": silent}, 1 << 20, 8, 64, max_num_seqs=2, snapshot_bytes=None).num_snapshot_slots == 0


def test_rollback_repoints_the_request_at_a_spare() -> None:
    manager = StateSlotManager(8, num_spares=3)
    a, b = make_request("a", [1]), make_request("b", [2])
    manager.allocate(a)
    manager.allocate(b)
    assert not manager.can_allocate(make_request("c", [3])) and manager.num_free == 0
    main, spares = manager.slot("a"), manager.held["a"].slots[1:]
    assert manager.verify_checkpoints(a, start=10, num_rows=3) == [*spares[:2], NO_CHECKPOINT]
    manager.rollback(a, 10 + 1 + 1)  # one draft accepted: the state after row 1
    assert manager.slot("a") == spares[1] and main in manager.held["a"].slots[1:]
    with pytest.raises(ValueError, match="no state checkpoint"):
        manager.rollback(a, 12)  # no verify step since
    manager.free(a)
    manager.free(b)
    assert sorted(manager.free_slots) == list(range(8))


def snapshot_coordinator(num_snapshots: int, interval: int = 8) -> KVCacheCoordinator:
    plan = CachePlan(num_blocks=32, num_state_slots=4, block_size=4, bytes_per_block=1, bytes_per_state_slot=1,
                     num_snapshot_slots=num_snapshots)
    return KVCacheCoordinator(plan, enable_prefix_caching=True, state_interval=interval)


def run_prompt(kv: KVCacheCoordinator, request: Request) -> list[int] | None:
    """Admit a request (with its prefix hit) and compute its prompt in one step."""
    cached = kv.find_cached_prefix(request)
    request.num_computed_tokens = len(cached) * kv.block_size
    n = request.num_tokens - request.num_computed_tokens
    assert kv.allocate_slots(request, n, cached)
    checkpoints = kv.state_checkpoints(request, len(request.prompt_token_ids), request.num_computed_tokens, n, False)
    request.num_computed_tokens += n
    kv.register_computed_blocks(request)
    return checkpoints


def test_snapshots_at_interval_and_prompt_end_resume_the_deepest_hit() -> None:
    kv = snapshot_coordinator(num_snapshots=8)
    first = make_request("a", list(range(14)))
    checkpoints = run_prompt(kv, first)
    assert checkpoints is not None
    # Boundaries at 8 (the interval) and 12 (the prompt's last full block): rows 7 and 11.
    assert [i for i, slot in enumerate(checkpoints) if slot != NO_CHECKPOINT] == [7, 11]
    assert all(slot >= 4 for slot in checkpoints if slot != NO_CHECKPOINT)  # snapshot slots follow request slots
    assert kv.snapshots.num_cached == 2 and kv.take_state_copies() == []
    kv.free(first)
    # Sharing 13 tokens: paged hit of 3 blocks (12 tokens), snapshot at 12: resume there.
    follow = make_request("b", list(range(13)) + [99, 98])
    assert len(kv.find_cached_prefix(follow)) == 3
    # Sharing 11 tokens: paged hit of 2 blocks, the deepest snapshot at or below is at 8.
    short = make_request("c", list(range(11)) + [97] * 6)
    assert len(kv.find_cached_prefix(short)) == 2
    run_prompt(kv, short)
    assert kv.take_state_copies() == [(checkpoints[7], kv.state_slot("c"))]
    assert kv.find_cached_prefix(make_request("d", list(range(14)), salt="other")) == []
    assert kv.snapshots.counters.hits == 3 and kv.snapshots.counters.lookups == 3


def test_snapshot_pool_evicts_the_least_recently_used() -> None:
    kv = snapshot_coordinator(num_snapshots=2, interval=8)
    prompts = [[100 * i + t for t in range(9)] for i in range(3)]  # one snapshot each, after 8 tokens
    for i in range(2):
        run_prompt(kv, request := make_request(str(i), prompts[i]))
        kv.free(request)
    assert kv.snapshots.num_cached == 2
    assert len(kv.find_cached_prefix(make_request("x", prompts[0] + [5]))) == 2  # prompt 0's snapshot used last
    run_prompt(kv, request := make_request("2", prompts[2]))
    kv.free(request)
    assert kv.snapshots.counters.evicted == 1 and kv.snapshots.num_cached == 2
    assert kv.find_cached_prefix(make_request("y", prompts[1] + [5])) == []  # the least recently used went
    assert len(kv.find_cached_prefix(make_request("z", prompts[0] + [5]))) == 2


def test_unpublished_snapshots_are_dropped_with_their_request() -> None:
    kv = snapshot_coordinator(num_snapshots=4)
    request = make_request("a", list(range(16)))
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, 16, cached)
    assert kv.state_checkpoints(request, 16, 0, 16, False) is not None
    kv.free(request, keep_snapshots=False)  # its step failed: the snapshots may never have been written
    assert kv.snapshots.num_cached == 0 and len(kv.snapshots.free_slots) == 4

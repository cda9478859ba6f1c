"""Async scheduling (step N+1 prepared while step N runs) gives exactly the synchronous outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=9, logprobs=3),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[17, 42, 99, 150]),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=15, min_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=14, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, seed=99, max_tokens=11, ignore_eos=True),
    ]
    return prompts, params


def run(path: Path, async_scheduling: bool, **options) -> tuple[list[tuple], int]:
    llm = LLM(str(path), device="cpu", async_scheduling=async_scheduling, **options)
    prompts, params = requests()
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()
    results = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]
    return results, llm.engine.stats().num_preemptions


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache_bytes": 1 << 22},
        {"kv_cache_bytes": 1 << 22, "max_num_batched_tokens": 7, "block_size": 4},
        # 36 blocks of 4 tokens: the batch cannot all fit, so requests are preempted mid-flight.
        {"kv_cache_bytes": 36 * 2 * 2 * 2 * 16 * 4 * 4, "block_size": 4, "max_model_len": 128},
    ],
    ids=["plain", "small-chunks", "preemption"],
)
def test_async_equals_sync(tmp_path: Path, options: dict) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    sync, preemptions = run(tmp_path, False, **options)
    asynchronous, async_preemptions = run(tmp_path, True, **options)
    # Tokens and finish reasons exactly; logprobs to float32 rounding, since under preemption the
    # two modes recompute a preempted prefix in differently composed batches.
    assert [(ids, reason) for ids, reason, _ in asynchronous] == [(ids, reason) for ids, reason, _ in sync]
    for (_, _, got), (_, _, want) in zip(asynchronous, sync):
        assert (got is None) == (want is None)
        for got_row, want_row in zip(got or [], want or []):
            assert list(got_row) == list(want_row)
            assert list(got_row.values()) == pytest.approx(list(want_row.values()), rel=1e-5)
    if "max_model_len" in options:
        assert preemptions > 0 and async_preemptions > 0
    lengths = [len(ids) for ids, _, _ in sync]
    assert lengths[4] == 1 and lengths[0] == 12 and lengths[3] >= 6


def test_abort_while_a_step_is_in_flight(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", async_scheduling=True, kv_cache_bytes=1 << 22)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("a")
    produced = []
    while engine.has_unfinished_requests():
        produced += [o.request_id for o in engine.step()]
    assert "a" not in produced and produced.count("b") >= 1
    assert engine.stats().kv_blocks_used == 0

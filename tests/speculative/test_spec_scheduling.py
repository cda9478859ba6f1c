"""Speculative decoding under the scheduler's pressure: preemption by recompute, priority order,
chunked prefill and prefix-cache hits all at once give exactly the greedy output of plain
decoding, and every accepted request finishes with its blocks freed."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TINY_CONFIGS, save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import EngineStats
from tokenmill.models.llama import head_dim_of

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # the batch below needs more: requests are preempted mid-flight, drafts included


def workload() -> tuple[list[list[int]], list[SamplingParams], list[int]]:
    """Eight greedy requests: repetitive prompts (the n-gram proposer finds matches), two that share
    a 24-token prefix (a prefix-cache hit once the first has run), mixed priorities and options."""
    shared = [(5 * j) % 97 + 3 for j in range(24)]
    prompts = [[(7 * i + j % (3 + i)) % 300 + 3 for j in range(6 + 5 * i)] for i in range(6)]
    prompts += [shared + [11, 12], shared + [13]]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=18, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[17, 42, 99, 150]),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=26, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=22, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    ]
    priorities = [3, 0, 2, 1, 0, 3, 1, 2]
    return prompts, params, priorities


def block_bytes(has_draft: bool) -> int:
    """KV bytes per block of the tiny Llama in float32, twice that when it drafts for itself."""
    c = TINY_CONFIGS["llama"]
    per_model = 2 * c.num_key_value_heads * head_dim_of(c) * 4 * c.num_hidden_layers * BLOCK_SIZE
    return per_model * (2 if has_draft else 1)


def run(path: Path, speculative_config: dict | None) -> tuple[list[tuple[list[int], str | None]], EngineStats]:
    has_draft = (speculative_config or {}).get("method") == "draft_model"
    llm = LLM(str(path), device="cpu", block_size=BLOCK_SIZE, max_model_len=64, max_num_batched_tokens=16,
              kv_cache_bytes=NUM_BLOCKS * block_bytes(has_draft), policy="priority",
              speculative_config=speculative_config)
    prompts, params, priorities = workload()
    outs = llm.generate(prompts, params, priority=priorities)
    stats = llm.engine.stats()
    assert stats.kv_blocks_total == NUM_BLOCKS
    assert stats.kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], stats


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> list[tuple[list[int], str | None]]:
    outputs, stats = run(checkpoint, None)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return outputs


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "fp8_draft_model"])
def test_speculation_under_preemption_priority_chunks_and_prefix_hits(
    checkpoint: Path, plain: list[tuple[list[int], str | None]], drafter: str
) -> None:
    """The n-gram proposer, the target drafting for itself (every draft accepted, so verify steps
    carry the most tokens, and a draft cache not recomputed after a preemption would show as
    rejections) and its FP8 copy (some drafts rejected and rolled back)."""
    spec: dict = {"method": "ngram", "num_speculative_tokens": 3}
    if drafter != "ngram":
        spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    if drafter == "fp8_draft_model":
        spec["quantization"] = "fp8"
    outputs, stats = run(checkpoint, spec)
    print(f"{drafter}: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hit tokens, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted")
    assert outputs == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0
    if drafter == "draft_model":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if drafter == "fp8_draft_model":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens

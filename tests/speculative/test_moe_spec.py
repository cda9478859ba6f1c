"""Speculative decoding on a MoE target (tiny random Qwen3-MoE, CPU): the n-gram proposer, the target
drafting for itself (a MoE draft: every draft accepted) and a copy of it with every weight rounded
to FP8 precision (some drafts rejected and rolled back) give plain decoding's greedy output, under
chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import EngineStats

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # too few for the batch below: requests are preempted mid-flight, drafts included
# K and V of 2 layers x 2 KV heads x 16 dims in float32, BLOCK_SIZE tokens a block.
TARGET_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE


def workload() -> list[list[int]]:
    """Repetitive prompts (the n-gram proposer finds matches) and two sharing a 24-token prefix."""
    shared = [(5 * j) % 97 + 3 for j in range(24)]
    prompts = [[(7 * i + j % (3 + i)) % 300 + 3 for j in range(6 + 7 * i)] for i in range(5)]
    return prompts + [shared + [11, 12], shared + [13]]


def run(target: Path, speculative_config: dict | None) -> tuple[list[list[int]], EngineStats]:
    has_draft = (speculative_config or {}).get("method") == "draft_model"
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=96,
              max_num_batched_tokens=16, kv_cache_bytes=NUM_BLOCKS * TARGET_BLOCK_BYTES * (2 if has_draft else 1),
              speculative_config=speculative_config)
    outs = llm.generate(workload(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.kv_blocks_total == NUM_BLOCKS and stats.kv_blocks_used == 0
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny_checkpoint("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def fp8_rounded_copy(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-fp8-rounded")
    for name in ("config.json", "generation_config.json"):
        if (target / name).is_file():
            (path / name).write_bytes((target / name).read_bytes())
    tensors = load_file(target / "model.safetensors")
    rounded = {}
    for name, tensor in tensors.items():
        scale = tensor.abs().max().clamp_min(1e-12) / 448.0
        rounded[name] = ((tensor / scale).to(torch.float8_e4m3fn).float() * scale).contiguous()
    save_file(rounded, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def plain(target: Path) -> list[list[int]]:
    outputs, stats = run(target, None)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    return outputs


@pytest.mark.parametrize("drafter", ["ngram", "self", "fp8_rounded_copy"])
def test_speculation_keeps_greedy_output(target: Path, fp8_rounded_copy: Path, plain: list[list[int]],
                                         drafter: str) -> None:
    spec: dict = {"method": "ngram", "num_speculative_tokens": 3}
    if drafter != "ngram":
        draft = target if drafter == "self" else fp8_rounded_copy
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "draft_sampling": "greedy"}
    outputs, stats = run(target, spec)
    print(f"{drafter}: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hit tokens, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted")
    assert outputs == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0
    if drafter == "self":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if drafter == "fp8_rounded_copy":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens

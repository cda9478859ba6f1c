"""MoE models through the whole engine (CPU, float32, tiny random Qwen2-MoE and Qwen3-MoE): greedy
output is the same alone and in batches of 4 and 16, with small prefill chunks, under forced
preemption, and with prefix-cache hits. Routing is per token, so nothing a batch holds may change
which experts a token gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams

GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ARCHS = ["qwen3_moe", "qwen2_moe"]
# K and V of 2 layers x 2 KV heads x 16 dims in float32, 8 tokens a block.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 8


def varied_prompts() -> list[list[int]]:
    """Sixteen prompts of 5 to 65 tokens."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 320, (5 + 4 * i,), generator=gen).tolist() for i in range(16)]


def greedy_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_24) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def engine(path: Path, **overrides) -> LLM:
    return LLM(str(path), **{**dict(device="cpu", dtype="float32", block_size=8, kv_cache_bytes=1 << 23), **overrides})


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(request.param, path)
    return path


@pytest.fixture(scope="module")
def solo(moe_dir: Path) -> list[list[int]]:
    """Each prompt run alone: the reference."""
    llm = engine(moe_dir, enable_prefix_caching=False)
    return [greedy_ids(llm, [prompt])[0] for prompt in varied_prompts()]


@pytest.mark.parametrize("batch", [4, 16])
def test_batch_invariance(moe_dir: Path, solo: list[list[int]], batch: int) -> None:
    llm = engine(moe_dir)
    prompts = varied_prompts()
    for start in range(0, len(prompts), batch):
        assert greedy_ids(llm, prompts[start: start + batch]) == solo[start: start + batch]


def test_batch_invariance_with_small_prefill_chunks(moe_dir: Path, solo: list[list[int]]) -> None:
    llm = engine(moe_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy_ids(llm, varied_prompts()) == solo


def test_batch_invariance_under_preemption(moe_dir: Path, solo: list[list[int]]) -> None:
    # 24 blocks of 8 tokens: far too few for 16 requests of up to 65 + 24 tokens at once.
    llm = engine(moe_dir, max_model_len=128, kv_cache_bytes=24 * BLOCK_BYTES)
    assert llm.engine.kv.num_blocks == 24
    assert greedy_ids(llm, varied_prompts()) == solo
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0


def test_prefix_cache_hits_keep_the_output(moe_dir: Path) -> None:
    prefix = list(range(100, 180))  # 80 tokens = 10 full blocks
    prompts = [prefix + [k, k + 1, k + 2] for k in range(4)]
    cached = engine(moe_dir)
    first = cached.generate([prompts[0]], GREEDY_24)[0]
    rest = cached.generate(prompts[1:], GREEDY_24)
    assert first.num_cached_tokens == 0
    assert all(out.num_cached_tokens == 80 for out in rest)
    uncached = engine(moe_dir, enable_prefix_caching=False)
    assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == greedy_ids(uncached, prompts)
    assert uncached.engine.stats().prefix_cache_hits == 0

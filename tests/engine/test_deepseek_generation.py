"""DeepSeek-V2 / V3 (and V3 with MoE layers) through the engine (float32, CPU): greedy output equals transformers' for
prompts of 5-300 tokens run alone and together under chunked prefill, prefix-cache hits and
preemption (latent blocks shared, reused and recomputed), and with speculation on (n-gram, the
target drafting for itself, its FP8 copy, a smaller DeepSeek-V3 whose latent rows are narrower
than the target's in the same blocks), whose verify steps go through the absorbed path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_models import deepseek_config, save_deepseek_checkpoint
from transformers import PretrainedConfig

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention.mla import ABSORBED_MAX_QUERY_LEN, MLAAttention

BLOCK_SIZE = 4
NUM_BLOCKS = 86  # 344 tokens (max_model_len 340 fits): the batch below needs about 900, so requests are preempted
MAX_TOKENS = 16
GAMMA = 3
BUDGET = 32  # prefill chunks of up to 32 tokens: longer than the absorbed path takes


def block_bytes(*configs: PretrainedConfig) -> int:
    """Latent bytes per block of the given models in float32 (kv_lora_rank + rope per token and layer)."""
    return sum(c.num_hidden_layers * BLOCK_SIZE * (c.kv_lora_rank + c.qk_rope_head_dim) * 4 for c in configs)


# A draft of the same family but another shape: one layer, q LoRA, a narrower latent.
SMALL_DRAFT = deepseek_config("v3", num_hidden_layers=1, first_k_dense_replace=1, kv_lora_rank=24)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    own = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 17, 40, 96, 150, 300)]
    shared = torch.randint(0, 320, (24,), generator=gen).tolist()
    return own + [shared + [11, 12], shared + [13]]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["v2", "v3", "v3-moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(checkpoint, transformers' greedy continuation of every prompt)."""
    path = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    hf_model = save_deepseek_checkpoint(deepseek_config(request.param), path)
    save_deepseek_checkpoint(SMALL_DRAFT, path / "small-draft", seed=1)
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                    for p in prompts()]
    return path, expected


def pressed_engine(path: Path, speculative_config: dict | None = None) -> LLM:
    configs = [deepseek_config("v2")]  # both tiny targets keep the same latent bytes
    draft = (speculative_config or {}).get("model")
    if draft is not None:
        configs.append(SMALL_DRAFT if draft.endswith("small-draft") else configs[0])
    return LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=340,
               max_num_batched_tokens=BUDGET, kv_cache_bytes=NUM_BLOCKS * block_bytes(*configs),
               speculative_config=speculative_config)


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]


def test_alone_and_batched_under_pressure_equal_transformers(model: tuple[Path, list[list[int]]]) -> None:
    path, expected = model
    roomy = LLM(str(path), device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=340,
                kv_cache_bytes=1 << 22)
    assert [greedy(roomy, [p])[0] for p in prompts()] == expected  # one request, one prefill chunk
    llm = pressed_engine(path)
    assert llm.engine.kv.num_blocks == NUM_BLOCKS
    assert greedy(llm, prompts()) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "fp8_draft_model", "small_draft_model"])
def test_speculation_keeps_greedy_output_and_verifies_through_the_absorbed_path(
    model: tuple[Path, list[list[int]]], drafter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = model
    spec: dict = {"method": "ngram", "num_speculative_tokens": GAMMA}
    if drafter != "ngram":
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": GAMMA}
    if drafter == "fp8_draft_model":
        spec["quantization"] = "fp8"  # its kv_b_proj too: absorbed from a dequantized copy
    if drafter == "small_draft_model":
        spec["model"] = str(path / "small-draft")
    llm = pressed_engine(path, spec)
    assert llm.engine.kv.num_blocks == NUM_BLOCKS
    calls: list[tuple[str, bool, list[int]]] = []  # (path, in a step that verifies drafts, query runs)
    verifying = [False]
    runner = llm.engine.runner
    execute = runner.execute

    def spied_execute(step, previous=None):
        verifying[0] = step.drafts is not None
        try:
            return execute(step, previous)
        finally:
            verifying[0] = False

    monkeypatch.setattr(runner, "execute", spied_execute)
    for name in ("attend_absorbed", "attend_upprojected"):
        real = getattr(MLAAttention, name)

        def spy(self, q_nope, q_pe, cache, metadata, _real=real, _name=name):
            calls.append((_name, verifying[0], list(metadata.query_lens_host)))
            return _real(self, q_nope, q_pe, cache, metadata)

        monkeypatch.setattr(MLAAttention, name, spy)

    assert greedy(llm, prompts()) == expected
    stats = llm.engine.stats()
    print(f"{drafter}: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-cache hit tokens, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_used == 0
    assert stats.spec_num_draft_tokens > 0
    if drafter != "small_draft_model":  # random weights of its own: its drafts may all be rejected
        assert stats.spec_num_accepted_tokens > 0
    if drafter == "draft_model":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if drafter == "fp8_draft_model":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert any(name == "attend_absorbed" and verify and 1 + GAMMA in runs for name, verify, runs in calls)
    assert all(min(runs) > ABSORBED_MAX_QUERY_LEN for name, _, runs in calls if name == "attend_upprojected")
    assert any(name == "attend_upprojected" for name, _, _ in calls)

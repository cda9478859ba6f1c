"""End to end on the real SmolLM2-135M: parity with transformers.generate, batch invariance,
prefix caching, seeded sampling and stop strings."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]

# Sixteen prompts of different lengths (4 to ~60 tokens).
VARIED = [
    " ".join(["Tell me about the history of"] + ["the old city walls"] * k + [f"number {k}."])
    for k in range(16)
]


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def greedy_ids(llm: LLM, prompts: list, params: SamplingParams = GREEDY_32) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def test_greedy_matches_transformers_generate(smollm2_llm: LLM, hf_smollm2) -> None:
    hf_model, tokenizer = hf_smollm2
    # Both stop at EOS (kept as the last token) or after 32 tokens.
    ours = greedy_ids(smollm2_llm, PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
        assert got == ref.tolist(), prompt
    assert sum(len(ids) for ids in ours) > 100


def test_chat_answer_names_paris(smollm2_llm: LLM) -> None:
    ids = chat_ids(smollm2_llm.tokenizer, "What is the capital of France?")
    out = smollm2_llm.generate([ids], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


@pytest.fixture(scope="module")
def solo_outputs(smollm2_llm: LLM) -> list[list[int]]:
    """Each of the sixteen prompts run alone: the reference for batch invariance."""
    return [greedy_ids(smollm2_llm, [p])[0] for p in VARIED]


@pytest.mark.parametrize("batch", [4, 16])
def test_batch_invariance(smollm2_llm: LLM, solo_outputs: list[list[int]], batch: int) -> None:
    for start in range(0, len(VARIED), batch):
        assert greedy_ids(smollm2_llm, VARIED[start : start + batch]) == solo_outputs[start : start + batch]


def test_batch_invariance_with_small_prefill_chunks(solo_outputs: list[list[int]]) -> None:
    llm = LLM(device="cpu", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy_ids(llm, VARIED) == solo_outputs


def test_batch_invariance_under_preemption(solo_outputs: list[list[int]]) -> None:
    # 24 blocks of 16 tokens hold 384 tokens: far too few for 16 requests of ~40 + 32 tokens.
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16
    llm = LLM(device="cpu", max_model_len=256, kv_cache_bytes=24 * block_bytes)
    assert llm.engine.kv.num_blocks == 24
    assert greedy_ids(llm, VARIED) == solo_outputs
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0


class TestPrefixCache:
    PREFIX = list(range(1000, 1200))  # 200 tokens of a shared prefix

    def test_second_request_computes_only_new_tokens(self) -> None:
        llm = LLM(device="cpu")
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = llm.generate([self.PREFIX + [5, 6, 7]], params)[0]
        before = llm.engine.stats()
        second = llm.generate([self.PREFIX + [8, 9, 10, 11]], params)[0]
        after = llm.engine.stats()
        # 200 shared tokens = 12 full blocks (192 tokens) served from the cache.
        assert second.num_cached_tokens == 192
        assert after.prefix_cache_hits - before.prefix_cache_hits == 192
        assert after.num_prompt_tokens - before.num_prompt_tokens == 204 - 192
        assert first.num_cached_tokens == 0

        salted = llm.generate([self.PREFIX + [8, 9, 10, 11]], params, cache_salt="tenant-b")[0]
        assert salted.num_cached_tokens == 0
        again = llm.generate([self.PREFIX + [8, 9, 10, 11]], params, cache_salt="tenant-b")[0]
        assert again.num_cached_tokens == 192
        assert salted.outputs[0].token_ids == again.outputs[0].token_ids == second.outputs[0].token_ids

    def test_outputs_identical_with_and_without_cache(self, smollm2_llm: LLM) -> None:
        prompts = [self.PREFIX + [k, k + 1] for k in range(4)]
        with_cache = greedy_ids(smollm2_llm, prompts)
        no_cache = LLM(device="cpu", enable_prefix_caching=False)
        assert greedy_ids(no_cache, prompts) == with_cache
        assert no_cache.engine.stats().prefix_cache_hits == 0


def test_seeded_sampling_reproduces(smollm2_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    first = greedy_ids(smollm2_llm, ["Write a short poem about rivers."], params)[0]
    # The same request again, now inside a batch with other (unseeded) requests.
    mixed = smollm2_llm.generate(
        ["Write a short poem about rivers.", "Hello there", "List some fruits:"],
        [params, SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.7, max_tokens=10)],
    )
    assert mixed[0].outputs[0].token_ids == first
    other_seed = greedy_ids(smollm2_llm, ["Write a short poem about rivers."], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=24, seed=4321, ignore_eos=True))[0]
    assert other_seed != first


def test_stop_string_across_token_boundaries(smollm2_llm: LLM) -> None:
    prompt = "Count: one, two, three, four, five, six, seven, eight,"
    full = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    # A stop string made of the end of one token and the start of the next.
    cut = full.index(",", 2) + 1
    stop = full[cut - 2 : cut + 2]
    assert len(stop) == 4
    out = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_n_samples_and_logprobs(smollm2_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2)
    out = smollm2_llm.generate(["The weather today is"], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert next(iter(entry)) == token
            assert 2 <= len(entry) <= 3
            assert all(v <= 0 for v in entry.values())

"""A draft model's pass over the prompt: it computes each prompt chunk behind the target's, so it
is prompt processing within the step's token budget and the first proposal catches up a single
token; after a prefix-cache hit its catch-up covers the cached prompt in forwards no larger than
the budget. Greedy output equals plain decoding throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams

BUDGET = 8
PROMPT = [(11 * j) % 300 + 3 for j in range(30)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


def engine(model_dir: Path, speculative: bool) -> LLM:
    spec = {"speculative_config": {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}}
    return LLM(str(model_dir), device="cpu", max_num_batched_tokens=BUDGET, kv_cache_bytes=1 << 22,
               **(spec if speculative else {}))


def record_draft_forwards(llm: LLM) -> list[list[int]]:
    """The positions of every forward of the draft model, in order."""
    model = llm.engine.proposer.draft.model
    forward = model.forward
    calls: list[list[int]] = []

    def recorded(input_ids: torch.Tensor, ctx):
        calls.append(ctx.positions.tolist())
        return forward(input_ids, ctx)

    model.forward = recorded
    return calls


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_the_draft_computes_each_prompt_chunk_with_the_target(model_dir: Path) -> None:
    reference = greedy(engine(model_dir, False), [PROMPT])
    llm = engine(model_dir, True)
    calls = record_draft_forwards(llm)
    assert greedy(llm, [PROMPT]) == reference
    chunks = [list(range(start, min(start + BUDGET, len(PROMPT)))) for start in range(0, len(PROMPT), BUDGET)]
    assert calls[: len(chunks)] == chunks  # the target's chunks, each once
    assert calls[len(chunks)] == [len(PROMPT)]  # the first proposal catches up the first sampled token alone
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_catch_up_after_a_prefix_hit_stays_within_the_token_budget(model_dir: Path) -> None:
    """The second request finds the first's prompt blocks cached: the target computes only the
    rest, and the draft, which holds nothing of the request yet, computes the whole prompt in its
    first catch-up, a budget's worth of rows per forward."""
    plain = engine(model_dir, False)
    second_prompt = PROMPT + [7, 8, 9]
    reference = greedy(plain, [PROMPT]) + greedy(plain, [second_prompt])
    llm = engine(model_dir, True)
    calls = record_draft_forwards(llm)
    first = greedy(llm, [PROMPT])
    calls.clear()
    second = greedy(llm, [second_prompt])
    assert first + second == reference
    assert llm.engine.stats().prefix_cache_hits > 0
    assert max(len(positions) for positions in calls) <= BUDGET
    catch_up = [p for positions in calls for p in positions][: len(second_prompt) + 1]
    assert catch_up == list(range(len(second_prompt) + 1))  # every position once, in order, then drafting


def test_several_requests_chunked_together_keep_greedy_output(model_dir: Path) -> None:
    """Prompts of different lengths share steps (a decode beside another's prompt chunk): the draft
    follows only the prompt chunks, and every request's output equals plain decoding's."""
    prompts = [PROMPT[: 5 + 7 * i] for i in range(4)]
    reference = greedy(engine(model_dir, False), prompts, max_tokens=16)
    llm = engine(model_dir, True)
    calls = record_draft_forwards(llm)
    assert greedy(llm, prompts, max_tokens=16) == reference
    assert max(len(positions) for positions in calls) <= BUDGET
    assert llm.engine.stats().spec_num_accepted_tokens > 0

"""Speculative decoding through the server: the `usage.speculative` extension (chat and completions,
whole and streamed) and the spec-decode counters in /metrics, on a real SmolLM2 engine with the
n-gram proposer, driven by the real `openai` client."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import RunningServer, start_server

pytestmark = pytest.mark.slow

GAMMA = 3
PARAGRAPH = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long, "
             "and the fox runs back to the forest before the farmer wakes up.")
EDIT = [{"role": "user", "content": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def spec_server() -> Iterator[RunningServer]:
    import torch

    from tokenmill.config import EngineConfig, ParallelConfig, SpeculativeConfig
    from tokenmill.engine.engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(
        parallel=ParallelConfig(device="cpu"),
        speculative=SpeculativeConfig.from_json(f'{{"method": "ngram", "num_speculative_tokens": {GAMMA}}}'),
    ))
    running = start_server(engine)
    yield running
    running.stop()


def _check(spec: dict[str, Any]) -> None:
    assert set(spec) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length"}
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0
    assert spec["num_drafts"] <= spec["num_draft_tokens"] <= GAMMA * spec["num_drafts"]
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])


def test_chat_usage(spec_server: RunningServer, server: RunningServer) -> None:
    client = spec_server.client()
    kwargs = dict(model=spec_server.state.model_name, messages=EDIT, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    spec = whole.usage.model_extra["speculative"]
    _check(spec)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.model_extra["speculative"] == spec  # greedy: the same drafts, the same verdicts
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content

    # Without speculation: the same greedy text, and the usage has no extension.
    plain = server.client().chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == whole.choices[0].message.content
    assert "speculative" not in (plain.usage.model_extra or {})


def test_completions_usage_sums_choices(spec_server: RunningServer) -> None:
    client = spec_server.client()
    prompt = f"{PARAGRAPH}\n\nThe same paragraph again:\n\n"
    kwargs = dict(model=spec_server.state.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    one = client.completions.create(**kwargs)
    spec = one.usage.model_extra["speculative"]
    _check(spec)
    two = client.completions.create(**kwargs, n=2)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    both = two.usage.model_extra["speculative"]
    assert {k: both[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} == {
        k: 2 * spec[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert both["mean_acceptance_length"] == pytest.approx(spec["mean_acceptance_length"])

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["speculative"] == spec


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """(label string, value) of every sample of one metric."""
    out = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            out.append((match.group(1) or "", float(match.group(2))))
    return out


def test_metrics(spec_server: RunningServer) -> None:
    client = spec_server.client()
    client.chat.completions.create(model=spec_server.state.model_name, messages=EDIT, max_tokens=MAX_TOKENS,
                                   temperature=0)
    text = httpx.get(f"{spec_server.url}/metrics").text
    stats = spec_server.engine_stats()

    def value(name: str) -> float:
        (sample,) = _samples(text, name)
        return sample[1]

    drafts = value("tokenmill:spec_decode_num_drafts_total")
    draft_tokens = value("tokenmill:spec_decode_num_draft_tokens_total")
    accepted = value("tokenmill:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    assert (drafts, draft_tokens, accepted) == (
        stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    assert value("tokenmill:spec_decode_mean_acceptance_length") == pytest.approx(1 + accepted / drafts)

    per_pos = {}
    for labels, v in _samples(text, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"):
        per_pos[int(re.search(r'position="(\d+)"', labels).group(1))] = v
    assert sorted(per_pos) == list(range(len(per_pos))) and 0 < len(per_pos) <= GAMMA
    counts = [per_pos[p] for p in sorted(per_pos)]
    assert counts == sorted(counts, reverse=True), counts  # a position is accepted only after all before it
    assert sum(counts) == accepted

"""Speculative decoding under CUDA graphs (draft decode, draft catch-up and verify steps):
greedy output equals plain eager decoding, and every graph family actually ran."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from no_host_sync import forbid_host_reads

from tokenmill import LLM, SamplingParams
from tokenmill.runner.cuda_graphs import StepGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 99, 3, 250, 11], list(range(40, 72)) * 3, [7] * 20, [901, 2, 33]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama saved as a real checkpoint, so target and draft can share weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def generate(model_dir: Path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=512, kv_cache_bytes=1 << 28, max_num_seqs=8,
              **kwargs)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return generate(model_dir, enforce_eager=True)[0]


@pytest.fixture
def graph_runs(monkeypatch: pytest.MonkeyPatch) -> Counter:
    runs: Counter = Counter()
    original = StepGraphs.run_outputs  # every replay, plain or padded, goes through it

    def counting(self, *args):
        runs[self.name] += 1
        return original(self, *args)

    monkeypatch.setattr(StepGraphs, "run_outputs", counting)
    original_pad = StepGraphs.pad

    def counting_pad(self, *args):
        runs["padded"] += 1
        return original_pad(self, *args)

    monkeypatch.setattr(StepGraphs, "pad", counting_pad)
    return runs


def test_draft_model_under_graphs_is_exact(model_dir: Path, reference, graph_runs: Counter) -> None:
    tokens, llm = generate(model_dir, speculative_config={"method": "draft_model", "model": str(model_dir),
                                                          "num_speculative_tokens": 4})
    assert tokens == reference
    # The draft is the target itself: nearly every draft is accepted, so the catch-up step
    # computes two new tokens (last draft + bonus) as often as one.
    assert llm.engine.spec_stats.mean_acceptance_length > 4.0
    assert graph_runs["verify"] > 0 and graph_runs["draft decode"] > 0 and graph_runs["draft catch-up"] > 0
    assert graph_runs["padded"] > 0  # the last proposals before max_tokens have fewer than gamma drafts


def test_fp8_draft_under_graphs_is_exact(model_dir: Path, reference, graph_runs: Counter) -> None:
    """The target quantized to FP8 weights as its own draft: the few-row kernel reads FP8 in the
    draft's decode and catch-up graphs; output unchanged, most drafts accepted."""
    tokens, llm = generate(model_dir, speculative_config={"method": "draft_model", "model": str(model_dir),
                                                          "num_speculative_tokens": 4, "quantization": "fp8"})
    assert tokens == reference
    assert llm.engine.proposer.draft.model.lm_head.weight.dtype == torch.float8_e4m3fn
    assert llm.engine.spec_stats.mean_acceptance_length > 3.0
    assert graph_runs["draft decode"] > 0 and graph_runs["draft catch-up"] > 0


def test_followed_catch_up_runs_behind_the_verify_without_reading_it(
    model_dir: Path, reference, graph_runs: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under graphs the next catch-up is launched behind each verify step from the device's copy
    of its result, reading nothing on the host; proposals draft from its logits (equal to a
    catch-up run after the host appended the tokens) and the output is plain decoding's."""
    from tokenmill.speculative.draft_model import DraftModelProposer, _FollowedCatchUp

    follow, logits_for, propose = DraftModelProposer._follow_verify, _FollowedCatchUp.logits_for, DraftModelProposer.propose
    proposers: list[DraftModelProposer] = []
    served = proposals = 0

    def guarded_follow(self, *args):
        with pytest.MonkeyPatch.context() as patch:
            forbid_host_reads(patch, "follow")
            follow(self, *args)

    def recorded(self, requests, limits):
        nonlocal proposals
        proposers[:] = [self]
        proposals += 1
        return propose(self, requests, limits)

    def checked(self, requests):
        nonlocal served
        logits = logits_for(self, requests)
        if logits is not None:
            drafted_from = logits.clone()  # the catch-up below replays the same graph into the same buffer
            tables = [proposers[0].kv.block_tables[r.request_id] for r in requests]
            torch.testing.assert_close(drafted_from, proposers[0]._catch_up(requests, tables), rtol=1e-4, atol=1e-4)
            served += 1
        return logits

    monkeypatch.setattr(DraftModelProposer, "_follow_verify", guarded_follow)
    monkeypatch.setattr(DraftModelProposer, "propose", recorded)
    monkeypatch.setattr(_FollowedCatchUp, "logits_for", checked)
    tokens, llm = generate(model_dir, speculative_config={"method": "draft_model", "model": str(model_dir),
                                                          "num_speculative_tokens": 4})
    assert tokens == reference
    # Every proposal but the first (after the prefill) drafts from a followed catch-up; each
    # replayed the catch-up graph once to serve and once more to be checked.
    assert served == proposals - 1 >= 5 and graph_runs["draft catch-up"] >= 2 * served


def test_ngram_under_graphs_is_exact(model_dir: Path, reference, graph_runs: Counter) -> None:
    tokens, llm = generate(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens == reference
    assert llm.engine.spec_stats.num_drafts > 0
    assert graph_runs["decode"] > 0
    # Requests with fewer drafts than gamma (shorter matches, the last tokens before max_tokens)
    # or none beside ones with drafts: padded into the verify graph, never eager.
    assert graph_runs["padded"] > 0 and graph_runs["verify"] >= graph_runs["padded"]

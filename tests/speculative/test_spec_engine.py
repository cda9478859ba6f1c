"""Speculative decoding end to end on the real SmolLM2: exact greedy output, drafts accepted,
the same sampled distribution with speculation on and off."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from no_host_sync import forbid_host_reads
from safetensors.torch import save_file
from scipy.stats import chi2_contingency

from tokenmill import LLM, SamplingParams
from tokenmill.config import BenchmarkOnlyConfig
from tokenmill.models.loader import iter_weights, load_hf_config, resolve_model

pytestmark = pytest.mark.slow

EDIT_PROMPT = (
    "Rewrite the following text, changing only the name Alice to Bob:\n\n"
    "Alice went to the market on Monday. Alice bought apples, pears and bread. On the way home, "
    "Alice met a friend and they talked about the weather, the market and the price of bread.\n\n"
    "Rewritten text:\n\n"
)
PROMPTS = [EDIT_PROMPT, "The capital of France is", "def fibonacci(n):\n    ", "List the days of the week:"]


def fp8_rounded(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as an FP8 E4M3 copy with a per-tensor scale would hold it, back in float32."""
    scale = tensor.abs().max().clamp_min(1e-12) / 448.0
    return ((tensor / scale).to(torch.float8_e4m3fn).float() * scale).contiguous()


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A lower-precision copy of SmolLM2 (every weight rounded to FP8): close to the target, not equal."""
    source = resolve_model(None)
    config = load_hf_config(source)
    config.architectures = ["LlamaForCausalLM"]
    tensors = {name: fp8_rounded(tensor.float()) for name, tensor in iter_weights(source)}
    path = tmp_path_factory.mktemp("smollm2-fp8-draft")
    config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def spec_llm(benchmark_only: BenchmarkOnlyConfig | None = None, **spec) -> LLM:
    return LLM(device="cpu", max_model_len=1024, kv_cache_bytes=1 << 28, speculative_config=spec,
               benchmark_only=benchmark_only or BenchmarkOnlyConfig())


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(device="cpu", max_model_len=1024, kv_cache_bytes=1 << 28)


def greedy(llm: LLM, max_tokens: int = 48) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference(plain: LLM) -> list[list[int]]:
    return greedy(plain)


def test_ngram_keeps_greedy_output_and_accepts_on_an_editing_task(reference: list[list[int]]) -> None:
    llm = spec_llm(method="ngram", num_speculative_tokens=4)
    assert greedy(llm) == reference
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens_per_pos[0] >= stats.spec_num_accepted_tokens_per_pos[-1]
    print(f"ngram: {stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted, "
          f"mean acceptance length {llm.engine.spec_stats.mean_acceptance_length:.2f}")


@pytest.mark.parametrize("verification", ["token", "block"])
def test_draft_model_keeps_greedy_output(draft_dir: Path, reference: list[list[int]], verification: str) -> None:
    llm = spec_llm(method="draft_model", model=str(draft_dir), num_speculative_tokens=4,
                   draft_sampling="greedy", verification=verification)
    assert greedy(llm) == reference
    length = llm.engine.spec_stats.mean_acceptance_length
    stats = llm.engine.stats()
    print(f"draft model (FP8-rounded copy, {verification}): mean acceptance length {length:.2f}, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted")
    assert 2.5 < length < 5.0  # close to the target but not equal: both branches of verification run
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("quantization,stored,least", [("fp8", torch.float8_e4m3fn, 3.5), ("nvfp4", torch.uint8, 2.5)])
def test_quantized_draft_keeps_greedy_output(reference: list[list[int]], quantization: str, stored: torch.dtype,
                                             least: float) -> None:
    """The target's own checkpoint as draft, quantized at load (FP8 weights with one scale per row;
    NVFP4 W4A16, E2M1 codes two a byte): output unchanged and most drafts accepted."""
    llm = spec_llm(method="draft_model", model=str(resolve_model(None).path), num_speculative_tokens=4,
                   draft_sampling="greedy", quantization=quantization)
    draft = llm.engine.proposer.draft.model
    assert draft.lm_head.weight.dtype == draft.model.layers[0].mlp.down_proj.weight.dtype == stored
    assert greedy(llm) == reference
    length = llm.engine.spec_stats.mean_acceptance_length
    print(f"draft model (SmolLM2 quantized to {quantization} at load): mean acceptance length {length:.2f}")
    assert least < length <= 5.0


def test_benchmark_acceptance_length_rejects_by_its_pattern(reference: list[list[int]]) -> None:
    """BENCHMARK-ONLY fixed pattern at 2.5: SmolLM2 drafting for itself (every draft equals the
    target's choice) has 1, 2, 1, 2, ... drafts accepted and the rest rolled back, then the
    target's argmax emitted: the same tokens as plain decoding, mean acceptance length 2.5 (the
    last steps, capped by max_tokens, accept fewer) and never a third draft accepted."""
    llm = spec_llm(method="draft_model", model=str(resolve_model(None).path), num_speculative_tokens=3,
                   draft_sampling="greedy",
                   benchmark_only=BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=2.5))
    assert greedy(llm) == reference
    stats = llm.engine.spec_stats
    print(f"fixed pattern 2.5: mean acceptance length {stats.mean_acceptance_length:.3f} over {stats.num_drafts} steps")
    assert 2.4 <= stats.mean_acceptance_length <= 2.5
    assert stats.accepted_per_position[0] == stats.num_drafts and stats.accepted_per_position[2] == 0


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_penalties_and_min_tokens_see_every_draft(draft_dir: Path, plain: LLM, draft_sampling: str) -> None:
    """Penalties count the drafts before each position (the proposer keeps them on the host for
    such requests) and min_tokens bans stop tokens at draft positions: greedy output with these
    options equals plain decoding's. Drafting by sampling mixes steps with a distribution (bans
    apply) and argmax steps (after min_tokens) in one proposal."""
    params = [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.8, frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=30)]
    prompts = [EDIT_PROMPT, PROMPTS[2], PROMPTS[3]]
    llm = spec_llm(method="draft_model", model=str(draft_dir), num_speculative_tokens=4, draft_sampling=draft_sampling)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_greedy_drafts_and_their_verification_never_read_the_device(
    draft_dir: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy drafting and greedy verification read no tensor value on the host: the drafts go
    from the draft model to the verify step on the device, and the output is still exact."""
    from tokenmill.sample import draft_verification as target_step
    from tokenmill.speculative.draft_model import DraftModelProposer

    llm = spec_llm(method="draft_model", model=str(draft_dir), num_speculative_tokens=4, draft_sampling="greedy")
    guarded_calls: list[str] = []

    def guarded(name: str, function):
        def run(*args, **kwargs):
            with pytest.MonkeyPatch.context() as patch:
                forbid_host_reads(patch, name)
                result = function(*args, **kwargs)
            guarded_calls.append(name)
            return result
        return run

    monkeypatch.setattr(DraftModelProposer, "propose", guarded("drafting", DraftModelProposer.propose))
    monkeypatch.setattr(target_step, "verify_drafts", guarded("verification", target_step.verify_drafts))
    assert greedy(llm) == reference
    assert {"drafting", "verification"} <= set(guarded_calls)


def test_a_followed_catch_up_gives_the_catch_ups_logits(
    draft_dir: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catch-up launched behind each verify step (its tokens chosen from the verify's result
    on the device) drafts from the same logits as the catch-up computed after the host appended
    the accepted tokens; it serves every proposal but the first, also once requests of its batch
    have finished (a subset of its rows), and the output is plain decoding's."""
    from tokenmill.speculative.draft_model import _FollowedCatchUp

    llm = spec_llm(method="draft_model", model=str(draft_dir), num_speculative_tokens=4, draft_sampling="greedy")
    proposer = llm.engine.proposer
    served: list[tuple[int, int]] = []  # (requests proposed for, rows the followed catch-up had)
    proposals = 0
    logits_for = _FollowedCatchUp.logits_for
    propose = type(proposer).propose

    def counted(self, requests, limits):
        nonlocal proposals
        proposals += 1
        return propose(self, requests, limits)

    def checked(self: _FollowedCatchUp, requests):
        logits = logits_for(self, requests)
        if logits is not None:
            tables = [proposer.kv.block_tables[r.request_id] for r in requests]
            torch.testing.assert_close(logits, proposer._catch_up(requests, tables), rtol=1e-4, atol=1e-4)
            served.append((len(requests), len(self.rows)))
        return logits

    monkeypatch.setattr(type(proposer), "propose", counted)
    monkeypatch.setattr(_FollowedCatchUp, "logits_for", checked)
    assert greedy(llm) == reference
    assert len(served) == proposals - 1 > 10  # the first proposal has no verify step before it
    assert any(n < rows for n, rows in served) and any(n == rows == len(PROMPTS) for n, rows in served)


def first_two_tokens(llm: LLM, n: int) -> Counter:
    # max_tokens=3: after the first token (sampled at prefill) one draft is verified, so the
    # second token is the output of verification (accepted draft or residual sample).
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=1000 + i, ignore_eos=True) for i in range(n)]
    outs = llm.generate(["Tell me a story about"] * n, params)
    return Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)


def test_sampling_with_a_draft_model_matches_sampling_without(draft_dir: Path, plain: LLM) -> None:
    """Two-sample chi-square over the first two sampled tokens, speculation on vs off."""
    n = 600
    off = first_two_tokens(plain, n)
    spec = spec_llm(method="draft_model", model=str(draft_dir), num_speculative_tokens=3)
    on = first_two_tokens(spec, n)
    assert spec.engine.stats().spec_num_drafts >= n  # every request verified a draft
    # Merge rare outcomes so every expected count is large enough for the test.
    common = [k for k in set(off) | set(on) if off[k] + on[k] >= 10]
    table = [[off[k] for k in common] + [n - sum(off[k] for k in common)],
             [on[k] for k in common] + [n - sum(on[k] for k in common)]]
    p = chi2_contingency(torch.tensor(table).numpy()).pvalue
    print(f"two-sample chi-square over {len(common) + 1} cells: p = {p:.3f}")
    assert p > 1e-3, f"distributions differ (p = {p:.2e})"

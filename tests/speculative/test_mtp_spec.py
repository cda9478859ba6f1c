"""MTP speculation end to end (CPU, float32, tiny random checkpoints with MTP heads): greedy output
identical with and without it for Qwen3-Next (MoE and dense), Qwen3.5 (dense and MoE), Qwen4Exp
and DeepSeek-V3, under chunked prefill, prefix-cache hits and preemption, with drafts both
accepted and rejected (a target that is nearly a bigram model and a head that passes the next
token's embedding through: tests/mtp_models.py's "copy" mode); a checkpoint without the head's
tensors is refused at start-up; the head's cache follows the target's exactly."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mtp_cases import GAMMA, engine, make_checkpoint, vocab_of, workload
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import EngineStats
from tokenmill.errors import ConfigError
from tokenmill.runner.cuda_graphs import StepGraphs

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(path: Path, prompts: list[list[int]], spec: dict | None, **overrides: object) -> tuple[list[list[int]], EngineStats]:
    llm = engine(path, spec, num_blocks=12, **overrides)
    outputs = llm.generate(prompts, PARAMS)
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs], stats


FAMILIES = ["qwen3_next", "qwen3_next-dense-interval2-half-rotary", "qwen3_5", "qwen3_5_moe", "qwen4exp",
            "qwen4exp-interval2-sigmoid-one-ple", "deepseek-v3", "deepseek-v3-neox-tied"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            make_checkpoint(name, made[name])
        return made[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_output_is_plain_decodings(name: str, checkpoints: Callable[[str], Path]) -> None:
    path = checkpoints(name)
    prompts = workload(vocab_of(name))
    plain, _ = run(path, prompts, None)
    spec, stats = run(path, prompts, {"method": "mtp", "num_speculative_tokens": GAMMA})
    print(f"{name}: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-hit tokens, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted, per position "
          f"{stats.spec_num_accepted_tokens_per_pos}")
    assert spec == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_num_accepted_tokens_per_pos[GAMMA - 1] > 0  # every draft of a proposal accepted, at times


@pytest.mark.parametrize("options", [{"verification": "block"}, {"draft_sampling": "greedy", "num_speculative_tokens": 1},
                                     {"num_speculative_tokens": 5}])
def test_verification_rules_and_draft_lengths_keep_the_output(options: dict, checkpoints: Callable[[str], Path]) -> None:
    path = checkpoints("qwen3_next")
    prompts = workload(vocab_of("qwen3_next"))
    plain, _ = run(path, prompts, None)
    spec, stats = run(path, prompts, {"method": "mtp", "num_speculative_tokens": GAMMA, **options})
    assert spec == plain and stats.spec_num_accepted_tokens > 0


def test_the_heads_cache_keeps_level_with_the_targets(checkpoints: Callable[[str], Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step the head has computed exactly the positions the target has (its rows
    follow the target's), and every proposal but a request's first is served from the row the
    step before left (no proposal skipped for want of it)."""
    from tokenmill.speculative.mtp import MTPProposer

    llm = engine(checkpoints("deepseek-v3"), {"method": "mtp", "num_speculative_tokens": GAMMA})
    proposer = llm.engine.proposer
    assert isinstance(proposer, MTPProposer)
    drafted, asked = [], []
    propose = MTPProposer.propose

    def counted(self, requests, limits):
        propose(self, requests, limits)
        asked.append(len(requests))
        drafted.append(sum(r.drafts.count > 0 for r in requests))
        for r in requests:
            assert r.draft_num_computed == r.num_computed_tokens == r.num_tokens - 1

    monkeypatch.setattr(MTPProposer, "propose", counted)
    llm.generate(workload(320), PARAMS)
    assert asked and drafted == asked


def test_a_checkpoint_without_the_heads_tensors_is_refused(tmp_path: Path, checkpoints: Callable[[str], Path]) -> None:
    source = checkpoints("qwen3_5")
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            (tmp_path / name).write_bytes((source / name).read_bytes())
    tensors = {n: t for n, t in load_file(source / "model.safetensors").items() if not n.startswith("mtp.")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_bytes=1 << 22, max_model_len=128)  # serves without MTP
    with pytest.raises(ConfigError, match="has no weights of the Qwen3_5ForCausalLM MTP head"):
        engine(tmp_path, {"method": "mtp", "num_speculative_tokens": GAMMA})


def test_a_model_without_an_mtp_head_is_refused(tmp_path: Path) -> None:
    from tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint("qwen3_moe", tmp_path)
    with pytest.raises(ConfigError, match="has no multi-token-prediction"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_bytes=1 << 22,
            speculative_config={"method": "mtp", "num_speculative_tokens": GAMMA})


def test_unknown_qwen4exp_mtp_layouts_are_refused(tmp_path: Path, checkpoints: Callable[[str], Path]) -> None:
    import json

    source = checkpoints("qwen4exp")
    for name in ("model.safetensors", "generation_config.json"):
        if (source / name).is_file():
            (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    for change, message in [({"mtp": {"mtp_use_hidden_state_from_layer": 40}}, "mtp_use_hidden_state_from_layer"),
                            ({"mtp": {"layer_types": ["linear_attention"]}}, "one QSA attention layer"),
                            ({"mtp": {"frobnicate": 1}}, r"sets \['frobnicate'\]"),
                            ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
                            ({"mtp_num_hidden_layers": 2}, "MTP heads of one layer")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message):
            engine(tmp_path, {"method": "mtp", "num_speculative_tokens": GAMMA})


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek-v3"])
def test_a_draft_vocabulary_restricts_the_heads_output(name: str, tmp_path: Path, checkpoints: Callable[[str], Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The head drafts only ids of the vocabulary file (its own output head of those rows, the
    target's untouched); the output is still plain decoding's. The file holds the tokens plain
    decoding emits most (as `tokenmill draft-vocab build` picks a deployment's), so acceptance
    stays near the full vocabulary's; both are printed."""
    from collections import Counter

    from tokenmill.speculative.draft_vocab import save_draft_vocab

    path = checkpoints(name)
    prompts = workload(vocab_of(name))
    plain, _ = run(path, prompts, None)
    _, full = run(path, prompts, {"method": "mtp", "num_speculative_tokens": GAMMA})
    counts = Counter(t for out in plain for t in out)
    ids = sorted(t for t, _ in counts.most_common(len(counts) // 2))
    vocab = save_draft_vocab(ids, tmp_path / "vocab.txt")
    drafted: list[int] = []
    from tokenmill.speculative.mtp import MTPProposer

    propose = MTPProposer.propose

    def recorded(self, requests, limits):
        propose(self, requests, limits)
        drafted.extend(t for r in requests if r.drafts.count for t in r.drafts.device_ids.tolist())

    monkeypatch.setattr(MTPProposer, "propose", recorded)
    spec = {"method": "mtp", "num_speculative_tokens": GAMMA, "draft_vocab": str(vocab)}
    llm = engine(path, spec, num_blocks=13)
    head, target = llm.engine.proposer.head, llm.engine.runner.model
    assert head.lm_head.weight.shape[0] == len(ids) and head.lm_head is not target.lm_head
    assert target.lm_head.weight.shape[0] == vocab_of(name)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    stats = llm.engine.stats()
    print(f"{name}: acceptance length with the full vocabulary {1 + full.spec_num_accepted_tokens / full.spec_num_drafts:.2f}, "
          f"with {len(ids)} of {vocab_of(name)} ids {1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts:.2f}")
    assert outputs == plain
    assert drafted and set(drafted) <= set(ids)
    assert stats.spec_num_accepted_tokens > 0


class _StagedEagerly(StepGraphs):
    """A StepGraphs whose "replay" runs the step function eagerly over the staged static buffers
    (CPU: nothing is captured): what a graph of the head reads, padding rows included."""

    def run_outputs(self, input_ids, ctx):
        bucket, context = self.stage(input_ids, ctx)
        static = self.static_context(bucket, context)
        batch = ctx.attention.num_requests
        lengths = ctx.attention.seq_lens_host + [self.query_len] * (bucket - batch)  # the torch backend reads them
        static.attention = dataclasses.replace(static.attention, seq_lens_host=lengths)
        outputs = self.step_function(self.input_ids[: bucket * self.query_len], static)
        return tuple(out[: batch * (out.shape[0] // bucket)] for out in outputs)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen4exp"])
def test_the_heads_steps_staged_in_graph_buffers_draft_what_eager_steps_draft(name: str,
                                                                             checkpoints: Callable[[str], Path]) -> None:
    """The head's following (1 + gamma rows per request) and chained (1 row) steps through the
    static buffers a CUDA graph replays (a batch of 3 padded to 4, the pick of each request's
    accepted row as a per-request input, the hidden states as per-token inputs): the same
    drafts, so the same acceptance, and plain decoding's output."""
    from tokenmill.models.interface import MTP_HIDDEN
    from tokenmill.runner.cuda_graphs import TokenInputSpec

    path = checkpoints(name)
    prompts = workload(vocab_of(name))
    spec = {"method": "mtp", "num_speculative_tokens": GAMMA}
    plain, _ = run(path, prompts, None)
    eager = engine(path, spec, max_num_batched_tokens=128)
    eager_out = [o.outputs[0].token_ids for o in eager.generate(prompts, PARAMS)]
    staged = engine(path, spec, max_num_batched_tokens=128)
    proposer, runner = staged.engine.proposer, staged.engine.runner
    inputs = {MTP_HIDDEN: TokenInputSpec((proposer.head.width,), torch.float32)}
    used: list[int] = []
    for q in (1, 1 + GAMMA):
        graphs = _StagedEagerly(proposer.head, 4, runner.max_blocks_per_seq, runner.num_blocks, runner.block_size,
                                96, runner.device, q, f"MTP {q}-row", request_inputs=proposer.head.request_inputs(),
                                step_function=proposer._picked, token_inputs=inputs)
        original = graphs.run_outputs
        graphs.run_outputs = lambda ids, ctx, q=q, original=original: used.append(q) or original(ids, ctx)
        proposer.graphs[q] = graphs
    staged_out = [o.outputs[0].token_ids for o in staged.generate(prompts, PARAMS)]
    assert eager_out == staged_out == plain
    assert set(used) == {1, 1 + GAMMA}
    a, b = eager.engine.stats(), staged.engine.stats()
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens) == (b.spec_num_draft_tokens, b.spec_num_accepted_tokens)


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_penalties_and_min_tokens_see_every_mtp_draft(draft_sampling: str, checkpoints: Callable[[str], Path]) -> None:
    """Penalties count the drafts before each position (the head's drafts kept on the host for such
    requests) and min_tokens bans stop tokens at draft positions: plain decoding's output."""
    path = checkpoints("deepseek-v3")
    prompts = workload(vocab_of("deepseek-v3"))[:3]
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=12, stop_token_ids=[5, 9])]
    plain = [o.outputs[0].token_ids for o in engine(path, None).generate(prompts, params)]
    llm = engine(path, {"method": "mtp", "num_speculative_tokens": GAMMA, "draft_sampling": draft_sampling})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats().spec_num_accepted_tokens > 0

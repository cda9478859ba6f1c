"""DFlash / DFlash2 speculation end to end (CPU, float32, tiny random targets and drafters written in
the published layout, tests/dflash_models.py): greedy output identical with and without it for a
dense, a MoE and a hybrid (Gated DeltaNet) target, under chunked prefill, prefix-cache hits and
preemption, with drafts accepted, rejected and accepted whole (the "repeat" targets and "copy"
drafters); verification rules and block lengths; the drafter's cache level with the target's and
its blocks launched behind the steps they follow."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dflash_models import TARGET_CONFIGS, drafter, save_drafter, save_target
from mtp_cases import engine, workload

from tokenmill import SamplingParams
from tokenmill.engine.engine import EngineStats

GAMMA = 3
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(path: Path, prompts: list[list[int]], spec: dict | None, **overrides: object) -> tuple[list[list[int]], EngineStats]:
    llm = engine(path, spec, num_blocks=12, **overrides)
    outputs = llm.generate(prompts, PARAMS)
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """(target, drafter) directories of a target and a copy drafter of a kind, made on first use."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}
    targets: dict[str, tuple[Path, object]] = {}

    def get(name: str, kind: str, **options: object) -> tuple[Path, Path]:
        key = (name, kind + repr(sorted(options.items())))
        if key not in made:
            if name not in targets:
                path = tmp_path_factory.mktemp(name)
                targets[name] = (path, save_target(name, path))
            path, model = targets[name]
            config = TARGET_CONFIGS[name]
            d = drafter(config, kind, copy_from=model.get_input_embeddings().weight.detach(),  # type: ignore[attr-defined]
                        target_layer_ids=(0, config.num_hidden_layers - 2), **options)
            made[key] = (path, save_drafter(d, tmp_path_factory.mktemp(f"{name}-{kind}")))
        return made[key]

    return get


def spec_of(kind: str, draft: Path, **options: object) -> dict:
    return {"method": kind, "model": str(draft), "num_speculative_tokens": GAMMA, **options}


CASES = [(name, kind) for name in ("llama", "qwen3_moe", "qwen3_next") for kind in ("dflash", "dflash2")]


@pytest.mark.parametrize("name,kind", CASES)
def test_greedy_output_is_plain_decodings(name: str, kind: str, checkpoints) -> None:
    target, draft = checkpoints(name, kind)
    prompts = workload(TARGET_CONFIGS[name].vocab_size - 1)
    plain, _ = run(target, prompts, None)
    spec, stats = run(target, prompts, spec_of(kind, draft))
    print(f"{name} {kind}: {stats.num_preemptions} preemptions, {stats.prefix_cache_hits} prefix-hit tokens, "
          f"{stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} drafts accepted, per position "
          f"{stats.spec_num_accepted_tokens_per_pos}")
    assert spec == plain
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_num_accepted_tokens_per_pos[GAMMA - 1] > 0  # whole blocks accepted at times


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("options", [{"verification": "block"}, {"draft_sampling": "greedy", "num_speculative_tokens": 1},
                                     {"num_speculative_tokens": 7}, {"draft_kv_cache_dtype": "fp8"}])
def test_verification_rules_block_lengths_and_an_fp8_draft_cache_keep_the_output(kind: str, options: dict,
                                                                                 checkpoints) -> None:
    target, draft = checkpoints("llama", kind)
    prompts = workload(TARGET_CONFIGS["llama"].vocab_size - 1)
    plain, _ = run(target, prompts, None)
    spec, stats = run(target, prompts, {**spec_of(kind, draft), **options})
    assert spec == plain and stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_drafters_cache_keeps_level_and_blocks_follow_their_steps(kind: str, checkpoints,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step the drafter's context covers exactly the target's computed positions, and
    a proposal runs a block of its own only for requests no step served (first proposals, after
    a preemption or near a reservation's end): most are drafted from the block that followed the
    verify step."""
    from tokenmill.speculative.dflash import DFlashProposer

    target, draft = checkpoints("llama", kind)
    llm = engine(target, spec_of(kind, draft))
    late, asked, proposing = [], [], [False]
    block, propose = DFlashProposer._block, DFlashProposer.propose

    def counted(self, requests, anchors, starts, bound):
        if proposing[0]:
            late.append(len(requests))
        return block(self, requests, anchors, starts, bound)

    def checked(self, requests, limits):
        for r in requests:
            assert r.draft_num_computed == r.num_computed_tokens == r.num_tokens - 1
        proposing[0] = True
        propose(self, requests, limits)
        proposing[0] = False
        asked.append(sum(r.drafts.count > 0 for r in requests))

    monkeypatch.setattr(DFlashProposer, "_block", counted)
    monkeypatch.setattr(DFlashProposer, "propose", checked)
    llm.generate(workload(63), PARAMS)
    print(f"{sum(late)} of {sum(asked)} drafting requests ran their own block")
    assert sum(asked) > 0 and sum(late) < sum(asked) / 2


def test_drafters_trained_on_shorter_blocks_are_refused_and_the_kind_must_match(checkpoints) -> None:
    from tokenmill.errors import ConfigError

    target, draft = checkpoints("llama", "dflash")
    with pytest.raises(ConfigError, match="block_size"):
        engine(target, spec_of("dflash", draft, num_speculative_tokens=8))
    with pytest.raises(ConfigError, match='use "method": "dflash"'):
        engine(target, spec_of("dflash2", draft))
    with pytest.raises(ConfigError, match="needs \"model\""):
        engine(target, {"method": "dflash", "num_speculative_tokens": GAMMA})

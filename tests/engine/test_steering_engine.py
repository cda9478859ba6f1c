"""Steering through the engine (tiny Llama, CPU): requests at strength 0 generate exactly what an
engine without --steering does (tokens and log-probabilities, batched with other strengths, under
chunked prefill); prefix-cache blocks are keyed by strength; bad strengths are refused; the first
rows' projections come back with the final output."""

from __future__ import annotations

from pathlib import Path

import pytest
from steering_files import write_steering_dir
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.kv.block_pool import hash_block

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=96, kv_cache_bytes=1 << 22)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
# No two share a prefix block: the steered requests' blocks are keyed apart, and hits would change the schedule.
PROMPTS = [[(7 * i + 3 * k + 1) % 300 for k in range(n)] for i, n in enumerate((5, 37, 12, 20, 9))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), **OPTIONS, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def steered(checkpoint: Path, plain: LLM) -> LLM:
    directory = write_steering_dir(plain.engine, checkpoint / "steer", layer=1)
    return LLM(str(checkpoint), **OPTIONS, max_num_batched_tokens=24, steering=str(directory), steering_max_strength=2.0)


def test_strength_zero_generates_exactly_as_without_steering(plain: LLM, steered: LLM) -> None:
    reference = plain.generate(PROMPTS, PARAMS)
    strengths = [{"refusal": 0.0}, {"refusal": 1.0}, None, {"refusal": 2.0}, {"refusal": 0.0}]
    outputs = steered.generate(PROMPTS, PARAMS, steering=strengths)
    changed = 0
    for ref, out, strength in zip(reference, outputs, strengths):
        if not strength or not strength["refusal"]:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].logprobs == ref.outputs[0].logprobs  # the same floats: the same logits
        else:
            changed += out.outputs[0].logprobs != ref.outputs[0].logprobs
    assert changed == 2


def test_first_rows_projections_come_back(steered: LLM) -> None:
    out = steered.generate([PROMPTS[0], PROMPTS[2]], [PARAMS, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)],
                           steering=[{"refusal": 1.0}, None])
    full, short = out[0].direction_projections["refusal"], out[1].direction_projections["refusal"]
    assert len(full) == 4 and len(short) == 2
    assert max(abs(p) for p in full) < 1e-5  # full ablation: nothing along the direction at its layer
    assert max(abs(p) for p in short) > 1e-4


def test_prefix_cache_blocks_are_keyed_by_strength(steered: LLM) -> None:
    prompt = list(range(100, 140))  # two full blocks of 16, then 8 tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)

    def run(strength: float | None) -> tuple[list, int]:
        out = steered.generate([prompt], params, steering=None if strength is None else {"refusal": strength})[0]
        return out.outputs[0].logprobs, out.num_cached_tokens

    def same(a: list, b: list) -> bool:  # a prefix hit computes fewer rows at once: equal up to rounding
        return [list(x) for x in a] == [list(y) for y in b] and all(
            x[t] == pytest.approx(y[t], rel=1e-5, abs=1e-6) for x, y in zip(a, b) for t in x)

    half, cached = run(0.5)
    assert cached == 0
    again, cached = run(0.5)
    assert cached == 32 and same(again, half)  # the same strength shares blocks
    full, cached = run(1.0)
    assert cached == 0 and not same(full, half)  # another strength shares none
    unsteered, cached = run(None)
    assert cached == 0
    zero, cached = run(0.0)
    assert cached == 32 and same(zero, unsteered)  # strength 0 is the unsteered computation: it shares with it
    again, cached = run(1.0)
    assert cached == 32 and same(again, full)


def test_the_block_hash_tags_cannot_be_spelled_by_a_salt() -> None:
    tagged = hash_block(None, [1, 2], "a", (("steering.refusal", float.hex(0.5)),))
    assert tagged != hash_block(None, [1, 2], "a")
    assert tagged != hash_block(None, [1, 2], "a", (("steering.refusal", float.hex(1.0)),))
    spelled = "a" + "steering.refusal\x00" + "\x00" * 8 + float.hex(0.5)
    assert tagged != hash_block(None, [1, 2], spelled)


@pytest.mark.parametrize("strength,message", [
    (-0.5, r"outside \[0, 2\]"), (2.5, r"outside \[0, 2\].*--steering-max-strength"),
    (float("nan"), "finite number"), (float("inf"), "finite number"), ("1", "finite number"), (True, "finite number"),
])
def test_bad_strengths_are_refused(steered: LLM, strength: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        steered.engine.add_request("bad", [1, 2, 3], PARAMS, steering={"refusal": strength})  # type: ignore[dict-item]
    assert "bad" not in steered.engine.requests


def test_unknown_direction_and_no_steering_file(plain: LLM, steered: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="'honesty' is not served"):
        steered.engine.add_request("bad", [1, 2, 3], PARAMS, steering={"honesty": 0.5})
    with pytest.raises(InvalidRequestError, match="serves no steering file.*--steering"):
        plain.engine.add_request("bad", [1, 2, 3], PARAMS, steering={"refusal": 0.5})
    plain.engine.add_request("fine", [1, 2, 3], PARAMS, steering={})  # nothing asked: fine anywhere
    plain.engine.abort_request("fine")

"""Residual steering (layers/steering.py) on a tiny Llama: strength 0 is the unsteered model bit for
bit in a batch with other strengths, strength 1 leaves no component along the direction in the
stream at any layer, the probe reads the stream at the direction's layer, and models without the
hook, or a file of another model, fail at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_models import deepseek_config, save_deepseek_checkpoint
from steering_files import random_direction, write_steering_dir
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM
from tokenmill.errors import ConfigError
from tokenmill.layers.steering import projection_output, strength_input
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import Chunk, pack

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=64, kv_cache_bytes=1 << 22)
TABLES = [[0, 1], [2, 3], [4, 5], [6, 7]]
PROMPTS = [[5, 9, 2, 7, 1, 3], [11, 4, 8], [17, 2, 3, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170],
           [5, 9, 2, 7, 1, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), **OPTIONS)


@pytest.fixture(scope="module")
def steered(checkpoint: Path, plain: LLM) -> LLM:
    return LLM(str(checkpoint), **OPTIONS, steering=str(write_steering_dir(plain.engine, checkpoint / "steer", layer=1)))


def forward(llm: LLM, strengths: list[float] | None, keep_hidden: tuple[int, ...] = ()) -> tuple[torch.Tensor, StepContext]:
    """Logits of every row of one prefill step of PROMPTS (fresh KV), with these strengths per request."""
    runner = llm.engine.runner
    ids, positions, metadata = pack([Chunk(p, 0, t) for p, t in zip(PROMPTS, TABLES)], runner.block_size, runner.device)
    ctx = StepContext(positions, metadata, keep_hidden=keep_hidden)
    if strengths is not None:
        ctx.request_inputs[strength_input("refusal")] = torch.tensor(strengths)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, ctx))
    return logits, ctx


def rows_of(request: int) -> slice:
    start = sum(len(p) for p in PROMPTS[:request])
    return slice(start, start + len(PROMPTS[request]))


def test_strength_zero_is_the_unsteered_model_exactly(plain: LLM, steered: LLM) -> None:
    reference, _ = forward(plain, None)
    logits, _ = forward(steered, [0.0, 1.0, 0.5, 0.0])
    for request in (0, 3):
        assert torch.equal(logits[rows_of(request)], reference[rows_of(request)])
    for request in (1, 2):
        assert not torch.allclose(logits[rows_of(request)], reference[rows_of(request)], atol=1e-3)
    # the steered server without strengths (its internal forwards) is the unsteered model too
    assert torch.equal(forward(steered, None)[0], reference)


def test_full_strength_leaves_no_component_along_the_direction(steered: LLM) -> None:
    direction = steered.engine.runner.model.residual_steering.direction
    layers = tuple(range(steered.engine.hf_config.num_hidden_layers))
    _, ctx = forward(steered, [1.0, 0.0, 0.5, 1.0], keep_hidden=layers)
    _, plain_ctx = forward(steered, [0.0, 0.0, 0.0, 0.0], keep_hidden=layers)
    for layer in layers:
        along = ctx.hidden[layer] @ direction
        for request in (0, 3):
            assert along[rows_of(request)].abs().max() < 1e-5, layer
        assert along[rows_of(1)].abs().max() > 1e-3  # strength 0: the stream keeps its component
        assert torch.equal(ctx.hidden[layer][rows_of(1)], plain_ctx.hidden[layer][rows_of(1)])
    # The probe is the stream entering the direction's layer, projected.
    probe = ctx.outputs[projection_output("refusal")]
    torch.testing.assert_close(probe, ctx.hidden[1] @ direction, rtol=1e-5, atol=1e-6)


def test_partial_strength_scales_each_write() -> None:
    from tokenmill.layers.attention import AttentionMetadata
    from tokenmill.layers.steering import ResidualSteering

    direction = random_direction(16, seed=3).float()
    steering = ResidualSteering("refusal", direction, 0, 2, use_triton=False)
    x = torch.randn(5, 16)
    metadata = AttentionMetadata(torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32),
                                 torch.zeros(2, 1, dtype=torch.int32), torch.arange(5), [2, 3], [2, 3])
    ctx = StepContext(torch.arange(5), metadata, request_inputs={strength_input("refusal"): torch.tensor([0.25, 2.0])})
    step = steering.step(ctx)
    out = step.ablate(x)
    torch.testing.assert_close(out @ direction, torch.tensor([0.75, 0.75, -1, -1, -1]) * (x @ direction))
    orthogonal = x - (x @ direction).unsqueeze(-1) * direction
    torch.testing.assert_close(out - (out @ direction).unsqueeze(-1) * direction, orthogonal, rtol=1e-5, atol=1e-6)


def test_direction_checks(steered: LLM) -> None:
    steering = steered.engine.runner.model.residual_steering
    with pytest.raises(ConfigError, match="unit length"):
        steering.set_direction(2 * steering.direction, 1)
    with pytest.raises(ConfigError, match="layer 7"):
        steering.set_direction(steering.direction.clone(), 7)


def test_a_file_of_another_model_is_refused(checkpoint: Path, plain: LLM, tmp_path: Path) -> None:
    other = tmp_path / "other"
    save_tiny_checkpoint("llama", other, seed=1)
    with pytest.raises(ConfigError, match="built for another model.*fingerprint"):
        LLM(str(other), **OPTIONS, steering=str(write_steering_dir(plain.engine, tmp_path / "steer")))


def test_models_without_the_hook_fail_closed(tmp_path: Path) -> None:
    save_deepseek_checkpoint(deepseek_config("v2"), tmp_path)
    options = dict(OPTIONS, max_model_len=128)
    directory = write_steering_dir(LLM(str(tmp_path), **options).engine, tmp_path / "steer")
    with pytest.raises(ConfigError, match="does not support residual steering"):
        LLM(str(tmp_path), **options, steering=str(directory))


def test_not_a_steering_directory(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a steering directory"):
        LLM(str(checkpoint), **OPTIONS, steering=str(tmp_path))

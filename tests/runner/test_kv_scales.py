"""FP8 KV scales at start-up: calibrated when the checkpoint has none, the checkpoint's when it
has them, ignored by a model-dtype cache; the calibration leaves nothing a request could read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser, main
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.numerics import FP8_E4M3_MAX
from tokenmill.quantization.kv_scales import CALIBRATION_TARGET
from tokenmill.runner.kv_calibration import calibration_token_ids, measure_kv_amax

PROMPT = list(range(3, 40))
BUDGET = 1 << 20


def small_kv_checkpoint(directory: Path, factor: float = 0.005) -> torch.nn.Module:
    """The tiny Llama with k_proj, v_proj scaled by `factor` and q_proj, o_proj by 1 / factor: the
    same function in exact arithmetic, but keys and values of ~0.005, E4M3 subnormals at scale 1.0."""
    model = save_tiny_checkpoint("llama", directory)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight.mul_(factor)
            attn.v_proj.weight.mul_(factor)
            attn.q_proj.weight.div_(factor)
            attn.o_proj.weight.div_(factor)
    model.save_pretrained(directory)
    return model


def with_scales(directory: Path, k_scales: list[float], v_scales: list[float]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, file, metadata={"format": "pt"})


def logits_and_tokens(llm: LLM, max_tokens: int = 8) -> tuple[torch.Tensor, list[int]]:
    """The logits of every sampled position of one greedy request, and its tokens."""
    seen: list[torch.Tensor] = []
    model = llm.engine.runner.model
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]  # type: ignore[method-assign]
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    finally:
        model.compute_logits = original  # type: ignore[method-assign]
    return torch.cat(seen).float(), out.outputs[0].token_ids


def relative_error(llm: LLM, reference: torch.nn.Module) -> float:
    ours, tokens = logits_and_tokens(llm)
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def fp8_llm(path: Path, **options: object) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8", kv_cache_bytes=BUDGET, **options)


def test_calibrated_scales_fit_e4m3_and_beat_scale_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    exact = small_kv_checkpoint(tmp_path)
    with caplog.at_level(logging.INFO, logger="tokenmill.quantization.kv_scales"):
        calibrated = fp8_llm(tmp_path)  # the default: calibrate a checkpoint without scales
    assert "calibrated the scales of 2 layers" in caplog.text
    unscaled = fp8_llm(tmp_path, calculate_kv_scales=False)
    assert all(a.k_scale == a.v_scale == 1.0 for a in unscaled.engine.runner.model.scaled_cache_layers())

    runner = calibrated.engine.runner
    layers = runner.model.scaled_cache_layers()
    ids, _ = calibration_token_ids(calibrated.engine.source, runner.vocab_size, 256)
    for layer, (k_cal, v_cal), (k_served, v_served) in zip(
        layers,
        measure_kv_amax(runner.model, ids, runner.block_size, runner.dtype, runner.device),
        measure_kv_amax(runner.model, PROMPT, runner.block_size, runner.dtype, runner.device),
    ):
        assert k_cal / layer.k_scale == pytest.approx(CALIBRATION_TARGET, rel=1e-5)
        assert v_cal / layer.v_scale == pytest.approx(CALIBRATION_TARGET, rel=1e-5)
        # What a request stores stays inside E4M3 and uses its upper range, not the subnormals.
        for stored_amax in (k_served / layer.k_scale, v_served / layer.v_scale):
            assert FP8_E4M3_MAX / 16 < stored_amax <= FP8_E4M3_MAX

    err_calibrated, err_unscaled = relative_error(calibrated, exact), relative_error(unscaled, exact)
    assert err_calibrated < 5e-2
    assert err_calibrated < err_unscaled / 3, (err_calibrated, err_unscaled)


def test_calibration_leaves_nothing_a_request_can_read(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    llm = fp8_llm(tmp_path, calculate_kv_scales=True)
    runner = llm.engine.runner
    for layer in runner.model.scaled_cache_layers():
        assert layer.k_scale != 1.0 and layer.v_scale != 1.0
        assert layer.backend is runner.backend
        assert layer.kv_cache.dtype == torch.float8_e4m3fn
        assert layer.kv_cache.shape[1] == runner.num_blocks + 1
        assert not layer.kv_cache.view(torch.uint8).any()
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.kv.pool.cached
    # Served output equals a fresh engine's with the same scales given by the checkpoint.
    layers = runner.model.scaled_cache_layers()
    given = tmp_path / "given"
    save_tiny_checkpoint("llama", given)
    with_scales(given, [a.k_scale for a in layers], [a.v_scale for a in layers])
    ours, tokens = logits_and_tokens(llm)
    theirs, their_tokens = logits_and_tokens(fp8_llm(given))
    assert tokens == their_tokens
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_checkpoint_scales_are_used_and_calibration_replaces_them_when_asked(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    with_scales(tmp_path, [0.25, 0.5], [0.125, 0.75])
    layers = fp8_llm(tmp_path).engine.runner.model.scaled_cache_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.25, 0.125), (0.5, 0.75)]
    layers = fp8_llm(tmp_path, calculate_kv_scales=False).engine.runner.model.scaled_cache_layers()
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.25, 0.125), (0.5, 0.75)]

    plain = tmp_path / "plain"
    save_tiny_checkpoint("llama", plain)
    recalibrated = fp8_llm(tmp_path, calculate_kv_scales=True).engine.runner.model.scaled_cache_layers()
    calibrated = fp8_llm(plain).engine.runner.model.scaled_cache_layers()
    # The checkpoint's scales take no part in the calibration forward.
    assert [(a.k_scale, a.v_scale) for a in recalibrated] == [(a.k_scale, a.v_scale) for a in calibrated]


def test_model_dtype_cache_ignores_checkpoint_scales(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    save_tiny_checkpoint("llama", plain)
    scaled = tmp_path / "scaled"
    save_tiny_checkpoint("llama", scaled)
    with_scales(scaled, [0.01, 0.02], [0.03, 0.04])
    llm = LLM(str(scaled), device="cpu", dtype="float32", kv_cache_bytes=BUDGET)
    assert all(a.k_scale == a.v_scale == 1.0 for a in llm.engine.runner.model.scaled_cache_layers())
    ours, tokens = logits_and_tokens(llm)
    theirs, their_tokens = logits_and_tokens(LLM(str(plain), device="cpu", dtype="float32", kv_cache_bytes=BUDGET))
    assert tokens == their_tokens
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_calculate_kv_scales_without_fp8_fails_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8"):
        EngineConfig(cache=CacheConfig(calculate_kv_scales=True)).finalize(256)
    EngineConfig(cache=CacheConfig(calculate_kv_scales=False)).finalize(256)  # off is fine with any cache
    save_tiny_checkpoint("llama", tmp_path)
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu", "--calculate-kv-scales"])
    assert code == 2
    assert "add --kv-cache-dtype fp8 or drop --calculate-kv-scales" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "expected"), [
    ([], None),
    (["--calculate-kv-scales"], True),
    (["--no-calculate-kv-scales"], False),
])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_calculate_kv_scales_flag(command: list[str], flags: list[str], expected: bool | None) -> None:
    args = build_parser().parse_args([*command, "--kv-cache-dtype", "fp8", *flags])
    config = EngineConfig.from_cli_args(args)
    assert config.cache.calculate_kv_scales is expected
    assert config.cache.kv_cache_dtype == "fp8"


def test_calibration_forward_restores_layers_on_error(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    runner = fp8_llm(tmp_path).engine.runner
    caches = [a.kv_cache for a in runner.model.scaled_cache_layers()]
    with pytest.raises(IndexError):
        measure_kv_amax(runner.model, [10**6], runner.block_size, runner.dtype, runner.device)  # not a token
    for layer, cache in zip(runner.model.scaled_cache_layers(), caches):
        assert layer.kv_cache is cache and isinstance(layer.backend, TorchReferenceBackend)


@pytest.mark.slow
def test_calibration_text_is_the_shipped_corpus_through_the_tokenizer(smollm2_path: Path) -> None:
    from tokenmill.models.loader import CheckpointSource, load_tokenizer

    source = CheckpointSource(smollm2_path.parent, smollm2_path)
    ids, what = calibration_token_ids(source, 49152, 300)
    assert len(ids) == 300 and "Opticks" in what
    text = load_tokenizer(source).decode(ids)
    assert text.lstrip().startswith("OPTICKS") and "Sir ISAAC NEWTON" in text

"""Bad input raises a clear error naming the problem; nothing hangs and the engine keeps working."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return LLM(str(path), device="cpu", max_model_len=64, kv_cache_bytes=1 << 22)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ("", SamplingParams(), "prompt is empty"),
        ("hello", SamplingParams(), "no tokenizer"),
        (list(range(64)), SamplingParams(), "context is 64 tokens"),
        (list(range(60)), SamplingParams(max_tokens=10), "ask for at most 4"),
        ([5, 100000], SamplingParams(), "outside the vocabulary"),
        ([1, 2, 3], SamplingParams(logprobs=50), "logprobs may be at most 20"),
    ],
)
def test_bad_requests_are_refused(tiny_llm: LLM, prompt, params, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate([prompt], params)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.stats().kv_blocks_used == 0
    # Still serving afterwards.
    again = tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(again.token_ids) == 3


def test_a_bad_prompt_in_a_list_adds_none_of_them(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[1, 2], [], [3, 4]], SamplingParams(max_tokens=2))
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -5}, "max_tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"n": 0}, "n must be at least 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_corrupt_safetensors(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(tmp_path), device="cpu", kv_cache_bytes=1 << 22)


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(bad))


def test_unhonourable_config_fails_at_start(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    with pytest.raises(ConfigError, match="--max-model-len"):
        LLM(str(tmp_path), device="cpu", max_model_len=100_000)
    with pytest.raises(ConfigError, match="could never fit"):
        LLM(str(tmp_path), device="cpu", kv_cache_bytes=4096)
    with pytest.raises(ConfigError, match="block-size"):
        LLM(str(tmp_path), device="cpu", block_size=12)


def test_cli_reports_errors_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error:") and "missing" in err and "Traceback" not in err

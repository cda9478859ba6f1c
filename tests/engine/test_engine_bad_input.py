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


def test_any_cache_salt_is_served(tiny_llm: LLM) -> None:
    """A salt that is half an emoji (a lone surrogate) once stopped the engine in the prefix-cache
    hash; now every str salts its own cache."""
    prompt = list(range(1, 40))  # more than two full blocks: the salt enters the first block's hash
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    for salt in ("\ud83d", "\udc00x", "\ud83d\ude00"):
        out = tiny_llm.generate([prompt], params, cache_salt=salt)[0]
        assert len(out.outputs[0].token_ids) == 3 and out.num_cached_tokens == 0  # no salt shares KV
    again = tiny_llm.generate([prompt], params, cache_salt="\ud83d")[0]
    assert again.num_cached_tokens == 32  # the same salt does


def test_a_failed_step_aborts_what_it_held_and_the_engine_goes_on(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("held", list(range(1, 20)), params)
    engine.step()  # "held" is running now
    engine.add_request("admitted", list(range(5, 30)), params)
    execute = engine.runner.execute

    def explode(*args: object, **kwargs: object) -> object:
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "execute", explode)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert sorted(engine.abort_failed_step()) == ["admitted", "held"]  # both were in the failed batch
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0
    monkeypatch.setattr(engine.runner, "execute", execute)
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


def test_a_step_that_fails_while_admitting_aborts_that_request(tiny_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("poison", list(range(1, 20)), params)
    engine.add_request("next", list(range(1, 20)), params)
    monkeypatch.setattr(engine.kv, "find_cached_prefix", lambda request: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError):
        engine.step()
    assert engine.abort_failed_step() == ["poison"]  # nothing was running: the one being admitted
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert [o.request_id for o in outputs] == ["next"] and engine.stats().kv_blocks_used == 0

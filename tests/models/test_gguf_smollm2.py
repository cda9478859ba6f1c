"""The real SmolLM2-135M-Instruct Q4_1 GGUF, read by tokenmill and by transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import PretrainedConfig

from tokenmill.models.gguf_file import open_gguf
from tokenmill.models.loader import CheckpointSource, iter_weights, load_hf_config, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_file_has_the_types_we_claim_to_cover(smollm2_dir: Path) -> None:
    types = {t.tensor_type for t in open_gguf(smollm2_dir / SMOLLM2_FILE).tensors.values()}
    assert types == {Q.F32, Q.Q4_1, Q.Q8_0}


def test_weights_equal_transformers(smollm2_ours: dict[str, torch.Tensor],
                                    smollm2_transformers: tuple[PretrainedConfig, dict[str, torch.Tensor]]) -> None:
    _, theirs = smollm2_transformers
    # transformers ties lm_head to the embedding; the GGUF stores no output.weight.
    assert sorted(smollm2_ours) == sorted(k for k in theirs if k != "lm_head.weight")
    assert len(smollm2_ours) == 272
    for name, tensor in smollm2_ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name


def test_config_equals_transformers(smollm2_dir: Path,
                                    smollm2_transformers: tuple[PretrainedConfig, dict[str, torch.Tensor]]) -> None:
    theirs, _ = smollm2_transformers
    ours = load_hf_config(resolve_model(smollm2_dir / SMOLLM2_FILE))
    assert type(ours) is type(theirs)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters == theirs.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert ours.tie_word_embeddings is True
    assert ours.num_hidden_layers == 30 and ours.num_key_value_heads == 3 and ours.head_dim == 64


def test_tokenizer_with_chat_template(smollm2_dir: Path, tmp_path: Path) -> None:
    source = CheckpointSource(smollm2_dir, smollm2_dir / SMOLLM2_FILE)
    tok = load_tokenizer(source)
    assert tok is not None
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    text = "The capital of France is Paris."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")

    # The same tokenizer saved beside a safetensors checkpoint comes back through the HF path.
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    again = load_tokenizer(resolve_model(tmp_path))
    assert again is not None
    assert again.encode(text, add_special_tokens=False) == ids
    assert again.chat_template == tok.chat_template


def test_weights_are_read_in_a_few_seconds(smollm2_dir: Path, smollm2_ours: dict[str, torch.Tensor]) -> None:
    import time

    start = time.perf_counter()
    n = sum(t.numel() for _, t in iter_weights(CheckpointSource(smollm2_dir, smollm2_dir / SMOLLM2_FILE)))
    assert n == sum(t.numel() for t in smollm2_ours.values())
    assert time.perf_counter() - start < 20  # ~2 s on 2 shared CPU cores; catches a per-element Python loop

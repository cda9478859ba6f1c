"""A model's step cost at depth from its shape (the scheduler's default prefill_attention_depth), and
whether its step memory grows with depth (the memory profile's context); the reference attention's
blocks of query rows give the unblocked result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tokenmill.layers.attention.torch_ref as torch_ref
from tokenmill.layers.attention import ATTENTION_BACKENDS, AttentionMetadata
from tokenmill.models.interface import ModelBuild
from tokenmill.models.loader import load_hf_config, resolve_model
from tokenmill.models.step_cost import (
    attention_flops_per_key,
    linear_flops_per_token,
    memory_grows_with_depth,
    prefill_attention_depth,
)
from tokenmill.runner.model_builder import _construct

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


def meta_model(config: dict, tmp_path: Path, backend: str = "torch"):
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = load_hf_config(resolve_model(tmp_path, need_weights=False))
    build = ModelBuild(hf_config, ATTENTION_BACKENDS[backend](), 2048, 16, torch.bfloat16, False, None)
    return _construct(build, torch.bfloat16, torch.device("meta"))


def test_the_8b_shape_costs_its_linear_layers_at_26k_tokens_of_depth(tmp_path: Path) -> None:
    model = meta_model(LLAMA_31_8B, tmp_path)
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # q k v, o, gate up down
    assert linear_flops_per_token(model) == 2 * 32 * per_layer  # the output head runs for sampled rows only
    assert attention_flops_per_key(model) == 32 * 4 * 32 * 128
    assert prefill_attention_depth(model) == 2 * 32 * per_layer // (32 * 4 * 32 * 128) == 26_624


def test_memory_grows_with_depth_unless_attention_streams_the_cache(tmp_path: Path) -> None:
    assert memory_grows_with_depth(meta_model(LLAMA_31_8B, tmp_path))  # the reference backend gathers keys
    assert not memory_grows_with_depth(meta_model(LLAMA_31_8B, tmp_path, "triton"))


def test_query_blocks_give_the_unblocked_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 8
    q_len, seq_len = 37, 80  # a chunk after 43 cached tokens
    cache = torch.randn(2, 12, block, kv_heads, dim)
    q, k, v = torch.randn(q_len, heads, dim), torch.randn(q_len, kv_heads, dim), torch.randn(q_len, kv_heads, dim)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(10, dtype=torch.int32)[None], slot_mapping=torch.arange(seq_len - q_len, seq_len),
        query_lens_host=[q_len], seq_lens_host=[seq_len])
    backend = torch_ref.TorchReferenceBackend()
    whole = backend.forward(q, k, v, cache.clone(), metadata, 0.25)
    monkeypatch.setattr(torch_ref, "MAX_SCORES", 5 * seq_len * heads)  # blocks of 5 query rows
    blocked = backend.forward(q, k, v, cache.clone(), metadata, 0.25)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)

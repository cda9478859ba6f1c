"""Tiny random Qwen4Exp text configs and helpers shared by the layer and model tests."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen4ExpTextConfig


def tiny_config(**overrides: object) -> Qwen4ExpTextConfig:
    """Every Qwen4Exp part at toy sizes: 3 GDN layers and one QSA layer (n_v != n_k), 3 streams,
    PLE on layers 1 and 2, a QSA budget of 8 tokens in blocks of 4, partial rotary."""
    fields: dict[str, object] = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 2], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=50, split_ngram_parts=4, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    fields.update(overrides)
    config = Qwen4ExpTextConfig(**fields)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_(module: nn.Module, seed: int, scale: float = 0.3) -> None:
    """Every floating parameter drawn anew (zero-initialised norm weights and convs included)."""
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        if param.is_floating_point():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)

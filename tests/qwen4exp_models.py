"""Tiny random Qwen4Exp models saved with transformers' own save_pretrained (per-expert MoE keys,
PLE tables in `split_ngram_parts` row shards, hash constants beside them), and their prompts.

Every switch is set in some config: QSA budgets far below the prompts (8 and 16 tokens) in
blocks of 4 and 2, attention every 4th layer or every 2nd, PLE on one layer and on two,
n-grams of 3 and 2, 3 and 4 streams, SiLU and sigmoid output gates, value heads 2 x and 3 x the
key heads, partial rotary 1/4 and 1/2, tied embeddings, a config without PLE. Recurrent decays
are slow and every zero-initialised weight (norms, PLE conv) is drawn, so state carried across
chunks matters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hybrid_models import random_prompts as hybrid_prompts
from hybrid_models import randomize_hybrid_
from qwen4exp_cases import tiny_config
from transformers import PretrainedConfig, Qwen4ExpForCausalLM

VOCAB = 97

QWEN4EXP_CONFIGS: dict[str, PretrainedConfig] = {
    "qwen4exp": tiny_config(),
    "qwen4exp-interval2-sigmoid-one-ple": tiny_config(
        full_attention_interval=2, output_gate_type="sigmoid", hc_count=4, hc_lowrank=6, ple_layer_ids=[3],
        ngram_size=2, heads_per_ngram=4, ple_embed_dim=16, ple_conv_kernel_size=3, indexer_budget=16,
        indexer_compress_ratio=2, indexer_n_heads=6, linear_num_value_heads=6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "qwen4exp-no-ple": tiny_config(ple_layer_ids=None),
}


def save_qwen4exp(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """The named model with seeded random weights, saved by transformers; returned in float32."""
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(QWEN4EXP_CONFIGS[name]).float()
    randomize_hybrid_(model, seed)
    model.save_pretrained(directory)
    return model.eval()


def random_prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """Random ids; an end-of-sequence id (3) falls about once per 97 tokens, as documents packed
    in one prompt would."""
    return hybrid_prompts(lengths, seed, VOCAB)

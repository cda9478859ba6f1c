"""Tiny random Hugging Face checkpoints of every architecture tokenmill runs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

TINY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "llama3-rope-tied": LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
    "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": Qwen3Config(**{**COMMON, "num_attention_heads": 2}, head_dim=48, tie_word_embeddings=False),
}

# Every routing variant of the two MoE families: norm_topk_prob on and off, sparse step 1 and 2,
# dense layers by index (mlp_only_layers), Qwen2-MoE's gated shared expert with and without q/k/v bias.
MOE_COMMON = dict(COMMON, max_position_embeddings=512, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  experts_implementation="eager")
TINY_MOE_CONFIGS: dict[str, PretrainedConfig] = {
    "qwen3_moe": Qwen3MoeConfig(**MOE_COMMON, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False),
    "qwen3_moe-no-renorm-step2": Qwen3MoeConfig(**MOE_COMMON, head_dim=16, norm_topk_prob=False, decoder_sparse_step=2,
                                                tie_word_embeddings=True),
    "qwen3_moe-mlp-only-top3": Qwen3MoeConfig(**{**MOE_COMMON, "num_hidden_layers": 3, "num_experts_per_tok": 3},
                                              head_dim=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": Qwen2MoeConfig(**MOE_COMMON, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                tie_word_embeddings=False),
    "qwen2_moe-renorm-step2-no-qkv-bias": Qwen2MoeConfig(**{**MOE_COMMON, "num_hidden_layers": 3},
                                                         shared_expert_intermediate_size=48, norm_topk_prob=True,
                                                         decoder_sparse_step=2, mlp_only_layers=[2], qkv_bias=False),
}


# SmolLM2-135M's real shapes (random weights): parity at full size where the GGUF cannot travel.
SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)


def save_tiny_checkpoint(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Build the named random model with a fixed seed, save it as safetensors, return it (float32)."""
    torch.manual_seed(seed)
    config = SMOLLM2_SHAPE if name == "smollm2-shape" else TINY_CONFIGS.get(name) or TINY_MOE_CONFIGS[name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Tiny models get larger weights than the default init, so logits are far from uniform.
    matrix_std = 0.02 if name == "smollm2-shape" else 0.08
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:  # norm weights
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, matrix_std)
    model.save_pretrained(directory)
    return model.eval()

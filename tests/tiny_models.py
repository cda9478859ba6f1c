"""Tiny random Hugging Face checkpoints of every architecture tokenmill runs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

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


# SmolLM2-135M's real shapes (random weights): parity at full size where the GGUF cannot travel.
SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)


def save_tiny_checkpoint(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Build the named random model with a fixed seed, save it as safetensors, return it (float32)."""
    torch.manual_seed(seed)
    config = SMOLLM2_SHAPE if name == "smollm2-shape" else TINY_CONFIGS[name]
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

"""Tiny random DeepSeek-V2 / V3 checkpoints: all layers dense (first_k_dense_replace equals the
layer count), or a dense first layer then MoE layers with DeepSeek's routing."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, PretrainedConfig

LAYERS = 2
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
             rms_norm_eps=1e-6, first_k_dense_replace=LAYERS, n_routed_experts=8, moe_intermediate_size=24,
             n_shared_experts=1, num_experts_per_tok=2)
# DeepSeek-V2-Lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707) over a 64-token original context.
V2_LITE_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


# Layer 0 dense, layer 1 MoE: 8 routed experts in 4 groups, the best 2 groups eligible, top-3 plus
# one shared expert. V2 routes softmax group-limited; V3 sigmoid with the correction bias, groups
# ranked by their two best scores, renormalised, then scaled.
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
           n_shared_experts=1, moe_intermediate_size=24)


def deepseek_config(name: str, **changes: object) -> PretrainedConfig:
    """v2: no q LoRA, YaRN, MLP bias. v3: q LoRA, interleaved rope, attention bias. v3-neox: q
    LoRA, rotate-half rope, the head tied to the embedding. v2-moe / v3-moe: v2 / v3 with MOE."""
    if name == "v2-moe":
        return deepseek_config("v2", **MOE, topk_method="group_limited_greedy", routed_scaling_factor=1.5, **changes)
    if name == "v3-moe":
        return deepseek_config("v3", **MOE, norm_topk_prob=True, routed_scaling_factor=2.5, **changes)
    if name == "v2":
        config = DeepseekV2Config(**SHAPE, q_lora_rank=None, max_position_embeddings=2560, rope_parameters=V2_LITE_YARN,
                                  mlp_bias=True, tie_word_embeddings=False)
    elif name == "v3":
        config = DeepseekV3Config(**SHAPE, q_lora_rank=24, max_position_embeddings=1024, rope_interleave=True,
                                  attention_bias=True, tie_word_embeddings=False)
    elif name == "v3-neox":
        config = DeepseekV3Config(**SHAPE, q_lora_rank=24, max_position_embeddings=1024, rope_interleave=False,
                                  tie_word_embeddings=True)
    else:
        raise KeyError(name)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def save_deepseek_checkpoint(config: PretrainedConfig, directory: Path, seed: int = 0) -> torch.nn.Module:
    """The random model (float32) saved as safetensors; weights larger than the default init so
    that logits are far from uniform."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3's: steers selection only
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return model.eval()

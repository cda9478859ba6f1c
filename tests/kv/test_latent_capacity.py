"""Latent-cache capacity against the expanded (per-head K/V) layout at the same byte budget, from
the cache specs of DeepSeek-V2-Lite- and V3-shaped models (built on the meta device: no weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, PretrainedConfig

from tokenmill.kv.planner import bytes_per_block, plan_caches
from tokenmill.kv.specs import LatentAttentionSpec
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.models.interface import ModelBuild
from tokenmill.models.registry import model_class

BLOCK = 64
BUDGET = 8 << 30
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=32768)
V2_LITE = DeepseekV2Config(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
                           first_k_dense_replace=27, intermediate_size=1408, architectures=["DeepseekV2ForCausalLM"],
                           **MLA)
V3_ATTENTION = DeepseekV3Config(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                                first_k_dense_replace=61, intermediate_size=64, architectures=["DeepseekV3ForCausalLM"],
                                **MLA)


def expanded_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Per-head keys (nope + rope) and values, every layer: what a non-latent cache would hold."""
    per_layer = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return config.num_hidden_layers * per_layer * dtype.itemsize


def latent_specs(config: PretrainedConfig, cache_dtype: torch.dtype) -> dict:
    build = ModelBuild(config, TorchReferenceBackend(), 32768, BLOCK, cache_dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = model_class(config)(build)
    finally:
        torch.set_default_dtype(default)
    return model.cache_specs()


@pytest.mark.parametrize(("config", "cache_dtype", "ratio"), [
    (V2_LITE, torch.bfloat16, 16 * 320 / 576),
    (V2_LITE, torch.float8_e4m3fn, 2 * 16 * 320 / 576),
    (V3_ATTENTION, torch.bfloat16, 128 * 320 / 576),
], ids=["v2-lite-bf16", "v2-lite-fp8", "v3-bf16"])
def test_latent_cache_holds_more_tokens_than_the_expanded_layout(config: PretrainedConfig, cache_dtype: torch.dtype,
                                                                 ratio: float) -> None:
    specs = latent_specs(config, cache_dtype)
    assert len(specs) == config.num_hidden_layers
    assert all(isinstance(s, LatentAttentionSpec) and s.latent_dim == 576 and s.dtype == cache_dtype
               for s in specs.values())
    assert bytes_per_block(specs) == config.num_hidden_layers * BLOCK * 576 * cache_dtype.itemsize
    latent_tokens = plan_caches(specs, BUDGET, BLOCK, 32768, 1).num_blocks * BLOCK
    expanded_tokens = BUDGET // expanded_bytes_per_token(config, torch.bfloat16)
    print(f"{config.num_attention_heads} heads, {config.num_hidden_layers} layers, {cache_dtype} latent: "
          f"{latent_tokens} tokens in {BUDGET >> 30} GiB against {expanded_tokens} expanded bf16 "
          f"({latent_tokens / expanded_tokens:.1f}x)")
    assert latent_tokens / expanded_tokens == pytest.approx(ratio, rel=2e-3)

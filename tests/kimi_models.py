"""Tiny random Kimi-Linear checkpoints saved with transformers' own save_pretrained (the original
checkpoint's names: `block_sparse_moe`, per-expert w1/w2/w3, q/k/v_conv1d, the forget gate's
tensors under `self_attn.`), and the engine settings their tests share.

Every switch is set in some config: the KDA/MLA layout from 1-indexed checkpoint lists
(`linear_attn_config`) or from 0-indexed `layer_types`, an MLA layer first or last, q LoRA on
and off, a dense first layer (first_k_dense_replace) or explicit `mlp_layer_types`, grouped
routing (4 groups, the best 2 eligible) or one group, one or two shared experts, renormalised
top-k or not. KDA heads (3) differ from MLA heads (4), and the recurrent parameters get slow
decays, so state carried across chunks and steps matters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.kimi_linear", reason="this transformers has no Kimi-Linear")

from transformers import AutoModelForCausalLM, KimiLinearConfig  # noqa: E402

VOCAB = 192
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_attention_heads=4,
              num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
              rms_norm_eps=1e-6, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              routed_scaling_factor=2.5, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              max_position_embeddings=1024, experts_implementation="eager")
KDA = dict(head_dim=8, num_heads=3, short_conv_kernel_size=4)


def kimi_config(name: str, **changes: object) -> KimiLinearConfig:
    """kimi: 3 KDA then 1 MLA (1-indexed lists), no q LoRA, layer 0 dense, one expert group.
    kimi-q-lora-grouped: KDA and MLA alternating (lists), q LoRA, two dense layers, 4 groups top-2
    of them, top-3, two shared experts, no renormalisation.
    kimi-mla-first: 0-indexed layer_types with MLA first and last, explicit mlp_layer_types."""
    if name == "kimi":
        fields = dict(num_hidden_layers=4, q_lora_rank=None, first_k_dense_replace=1, norm_topk_prob=True,
                      linear_attn_config={**KDA, "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    elif name == "kimi-q-lora-grouped":
        fields = dict(num_hidden_layers=4, q_lora_rank=12, first_k_dense_replace=2, n_group=4, topk_group=2,
                      num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=False,
                      linear_attn_config={**KDA, "kda_layers": [1, 3], "full_attn_layers": [2, 4]})
    elif name == "kimi-mla-first":
        fields = dict(num_hidden_layers=4, q_lora_rank=None, linear_attn_config=dict(KDA), norm_topk_prob=True,
                      layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                      mlp_layer_types=["sparse", "dense", "sparse", "sparse"])
    else:
        raise KeyError(name)
    return KimiLinearConfig(**{**COMMON, **fields, **changes})


KIMI_CONFIGS = ["kimi", "kimi-q-lora-grouped", "kimi-mla-first"]


@torch.no_grad()
def randomize_kimi_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights: slow KDA decays, norms around 1, the rest small; router correction biases
    that steer the selection."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # decay rates exp(A_log) * softplus(f + dt_bias): slow
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.5, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 2.0)
        elif p.dim() == 1:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + 1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)


def save_kimi(name: str, directory: Path, seed: int = 0, **changes: object) -> torch.nn.Module:
    """The named model with seeded random weights, saved by transformers; returned in float32."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(kimi_config(name, **changes), dtype=torch.float32)
    randomize_kimi_(model, seed)
    model.save_pretrained(directory)
    return model.eval()

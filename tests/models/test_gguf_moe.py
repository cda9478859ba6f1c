"""Qwen2-MoE and Qwen3-MoE GGUF files written here the way llama.cpp's convert_hf_to_gguf writes them
(experts stacked as ffn_{gate,up,down}_exps [E, rows, cols], the router as ffn_gate_inp, the shared
expert as ffn_*_shexp with its gate ffn_gate_inp_shexp kept as [H]): the config comes back from the
metadata, and the model loaded from the file has transformers' logits."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from parity import check_parity
from tiny_models import save_tiny_checkpoint
from transformers import PreTrainedModel

from tokenmill import LLM
from tokenmill.errors import ModelLoadError
from tokenmill.models.llama import head_dim_of
from tokenmill.models.loader import iter_weights, load_hf_config, resolve_model

ARCH = {"qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
EXPERTS = {"experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "experts.down_proj": ("ffn_down_exps",)}


def gguf_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """GGUF name -> array (PyTorch order) of every tensor convert_hf_to_gguf writes for the model."""
    cfg = model.config
    names = gguf.get_tensor_name_map(ARCH[cfg.model_type], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        stacked = next((v for k, v in EXPERTS.items() if hf_name.endswith(k)), None)
        if stacked:
            for gguf_kind, part in zip(stacked, np.split(w, len(stacked), axis=1)):
                out[f"blk.{layer}.{gguf_kind}.weight"] = part
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if hf_name.endswith("shared_expert_gate.weight"):
            w = w[0]
        out[f"{names.get_name(base)}.{suffix}"] = w
    return out


def write_moe_gguf(path: Path, model: PreTrainedModel, expert_type: Q = Q.F32) -> dict[str, np.ndarray]:
    """Write the model; return what each GGUF tensor decodes to."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH[cfg.model_type]])
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type == "qwen3_moe":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    decoded = {}
    for name, w in gguf_tensors(model).items():
        qtype = expert_type if "_exps." in name else Q.F32
        data = gguf.quants.quantize(w, qtype) if qtype != Q.F32 else w
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
        decoded[name] = gguf.quants.dequantize(data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_gguf_config_and_logits_match_transformers(arch: str, tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint(arch, tmp_path / "hf")
    path = tmp_path / "tiny-moe.gguf"
    write_moe_gguf(path, hf_model)
    config = load_hf_config(resolve_model(path))
    ref = hf_model.config
    assert config.model_type == ref.model_type
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "intermediate_size", "num_hidden_layers"):
        assert getattr(config, field) == getattr(ref, field), field
    assert head_dim_of(config) == head_dim_of(ref)
    if ref.model_type == "qwen2_moe":
        assert config.shared_expert_intermediate_size == ref.shared_expert_intermediate_size
        assert config.qkv_bias is True
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=32, kv_cache_bytes=1 << 22)
    prompt = torch.randint(0, ref.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    check_parity(llm, hf_model, prompt, steps=8, tol=1e-4)


def test_quantized_expert_tensors_come_out_per_expert(tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint("qwen2_moe", tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    decoded = write_moe_gguf(path, hf_model, expert_type=Q.Q8_0)
    ours = dict(iter_weights(resolve_model(path)))
    experts = hf_model.config.num_experts
    for kind, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        stacked = decoded[f"blk.1.ffn_{kind}_exps.weight"]
        for e in range(experts):
            torch.testing.assert_close(ours[f"model.layers.1.mlp.experts.{e}.{proj}.weight"],
                                       torch.from_numpy(stacked[e].copy()), rtol=0, atol=0)
    assert ours["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, hf_model.config.hidden_size)
    assert "model.layers.0.mlp.gate.weight" in ours


def test_moe_gguf_without_routers_is_refused(tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint("qwen3_moe", tmp_path / "hf")
    path = tmp_path / "broken.gguf"
    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    for name, w in gguf_tensors(hf_model).items():
        if "ffn_gate_inp" not in name:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="without any router tensor"):
        load_hf_config(resolve_model(path))

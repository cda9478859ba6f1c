"""Building the transformers config of a GGUF checkpoint from its metadata and tensor shapes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType
from transformers import (
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tokenmill.errors import ModelLoadError
from tokenmill.models.gguf_file import SUPPORTED_GGUF_ARCHS, GGUFCheckpoint

_Q = GGMLQuantizationType
# llama.cpp's graphs fix whether the top-k routing weights are renormalised (norm_topk_prob) unless
# the file says `<arch>.expert_weights_norm`.
_MOE_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}


def gguf_to_hf_config(ckpt: GGUFCheckpoint) -> PretrainedConfig:
    """The transformers config (Llama/Mistral/Qwen2/Qwen3/Qwen2-MoE/Qwen3-MoE) that the GGUF's tensors belong to."""
    arch = ckpt.arch
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"{ckpt.path}: GGUF architecture {arch!r} is not supported; "
            f"tokenmill reads GGUF files of: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    if "token_embd.weight" not in ckpt.tensors:
        raise ModelLoadError(f"{ckpt.path}: GGUF file has no 'token_embd.weight' tensor")
    n_layers = ckpt.require_int("block_count")
    hidden = ckpt.require_int("embedding_length")
    n_head = ckpt.require_int("attention.head_count")
    n_kv_head = ckpt.get_int("attention.head_count_kv") or n_head
    head_dim = _head_dim(ckpt, hidden, n_head)
    vocab_size = ckpt.tensor_shape("token_embd.weight")[0]
    moe = _moe_fields(ckpt, n_layers) if arch in _MOE_NORM_TOPK_PROB else {}
    intermediate = ckpt.get_int("feed_forward_length")
    if intermediate is None and "blk.0.ffn_up.weight" in ckpt.tensors:
        intermediate = ckpt.tensor_shape("blk.0.ffn_up.weight")[0]
    intermediate = intermediate or moe.get("moe_intermediate_size")  # no dense layer needs one
    if intermediate is None:
        raise ModelLoadError(f"{ckpt.path}: cannot tell the MLP size (no '{arch}.feed_forward_length')")

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        head_dim=head_dim,
        max_position_embeddings=ckpt.get_int("context_length", 4096),
        rms_norm_eps=ckpt.get_float("attention.layer_norm_rms_epsilon", 1e-6),
        rope_parameters=_rope_parameters(ckpt, head_dim),
        # llama.cpp writes no output.weight when the HF model ties lm_head to the embedding.
        tie_word_embeddings="output.weight" not in ckpt.tensors,
        dtype=_checkpoint_dtype(ckpt),
        **_special_token_ids(ckpt),
    )
    has_attn_bias = "blk.0.attn_q.bias" in ckpt.tensors
    name = (ckpt.get_str("general.name") or "").lower()
    if arch == "llama" and "mistral" in name:
        # convert_hf_to_gguf writes Mistral as "llama" and keeps no sliding window: llama.cpp attends fully.
        return MistralConfig(sliding_window=ckpt.get_int("attention.sliding_window"), **kwargs)
    if arch == "llama":
        return LlamaConfig(
            attention_bias=has_attn_bias, mlp_bias="blk.0.ffn_up.bias" in ckpt.tensors, **kwargs
        )
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **kwargs)
    if arch == "qwen2moe":
        return Qwen2MoeConfig(qkv_bias=has_attn_bias, use_sliding_window=False, **kwargs, **moe)
    if arch == "qwen3moe":
        return Qwen3MoeConfig(attention_bias=has_attn_bias, use_sliding_window=False, **kwargs, **moe)
    return Qwen3Config(attention_bias=has_attn_bias, use_sliding_window=False, **kwargs)


def _moe_fields(ckpt: GGUFCheckpoint, n_layers: int) -> dict[str, Any]:
    """Expert counts and sizes, and which layers are sparse (those with a router, ffn_gate_inp)."""
    sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in ckpt.tensors]
    if not sparse:
        raise ModelLoadError(f"{ckpt.path}: a {ckpt.arch} GGUF without any router tensor (blk.N.ffn_gate_inp)")
    gating = ckpt.get_int("expert_gating_func")
    if gating is not None and gating != ExpertGatingFuncType.SOFTMAX:
        raise ModelLoadError(f"{ckpt.path}: {ckpt.arch} routers score with softmax; the file asks for gating "
                             f"function {gating}")
    first = f"blk.{sparse[0]}"
    norm = ckpt.get(ckpt.arch_key("expert_weights_norm"))
    fields: dict[str, Any] = dict(
        num_experts=ckpt.require_int("expert_count"),
        num_experts_per_tok=ckpt.require_int("expert_used_count"),
        moe_intermediate_size=ckpt.get_int("expert_feed_forward_length")
        or ckpt.tensor_shape(f"{first}.ffn_gate_exps.weight")[1],
        norm_topk_prob=_MOE_NORM_TOPK_PROB[ckpt.arch] if norm is None else bool(norm),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(n_layers) if i not in sparse],
    )
    if ckpt.arch == "qwen2moe":
        shared = f"{first}.ffn_gate_shexp.weight"
        fields["shared_expert_intermediate_size"] = (
            (ckpt.get_int("expert_shared_feed_forward_length") or ckpt.tensor_shape(shared)[0])
            if shared in ckpt.tensors else 0)
    return fields


def _head_dim(ckpt: GGUFCheckpoint, hidden: int, n_head: int) -> int:
    q_rows = ckpt.tensor_shape("blk.0.attn_q.weight")[0] if "blk.0.attn_q.weight" in ckpt.tensors else None
    head_dim = ckpt.get_int("attention.key_length")
    if head_dim is None:
        head_dim = (q_rows if q_rows is not None else hidden) // n_head
    if q_rows is not None and q_rows != n_head * head_dim:
        raise ModelLoadError(
            f"{ckpt.path}: attn_q has {q_rows} rows but the metadata says {n_head} heads of {head_dim}; "
            "the file is inconsistent"
        )
    rot = ckpt.get_int("rope.dimension_count") or head_dim
    if rot != head_dim:
        raise ModelLoadError(
            f"{ckpt.path}: rotary dimension {rot} differs from head_dim {head_dim}; "
            "partial rotary embeddings are not supported for this architecture"
        )
    return head_dim


def _special_token_ids(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        value = ckpt.get(f"tokenizer.ggml.{gguf_key}_token_id")
        ids[hf_key] = None if value is None else int(value)
    eos = ckpt.get("tokenizer.ggml.eos_token_id")
    eot = ckpt.get("tokenizer.ggml.eot_token_id")
    stops = [int(v) for v in (eos, eot) if v is not None]
    stops = list(dict.fromkeys(stops))
    ids["eos_token_id"] = None if not stops else stops[0] if len(stops) == 1 else stops
    return ids


def _checkpoint_dtype(ckpt: GGUFCheckpoint) -> torch.dtype:
    """The dtype to run the model in: the float type of the stored matrices, bfloat16 if quantized."""
    types = {t.tensor_type for t in ckpt.tensors.values() if len(t.shape) >= 2}
    if _Q.BF16 in types:
        return torch.bfloat16
    if types == {_Q.F32}:
        return torch.float32
    if types <= {_Q.F32, _Q.F16}:
        return torch.float16
    return torch.bfloat16


def _rope_parameters(ckpt: GGUFCheckpoint, head_dim: int) -> dict[str, Any]:
    theta = ckpt.get_float("rope.freq_base") or 10000.0
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = ckpt.get_str(ckpt.arch_key("rope.scaling.type"))
    factor = ckpt.get_float("rope.scaling.factor") or ckpt.get_float("rope.scale_linear")
    if scaling in (None, "none") and factor is not None and factor != 1.0:
        scaling = "linear"
    if scaling == "linear" and factor is not None and factor != 1.0:
        params.update(rope_type="linear", factor=factor)
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=factor or 1.0)
        orig = ckpt.get_int("rope.scaling.original_context_length")
        if orig is not None:
            params["original_max_position_embeddings"] = orig
        for hf_key, suffix in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = ckpt.get_float(f"rope.scaling.{suffix}")
            if value is not None:
                params[hf_key] = value
    elif scaling not in (None, "none", "linear"):
        raise ModelLoadError(
            f"{ckpt.path}: rope scaling type {scaling!r} is not supported (supported: linear, yarn, llama3)"
        )
    if "rope_freqs.weight" in ckpt.tensors:
        if params["rope_type"] != "default":
            raise ModelLoadError(f"{ckpt.path}: both rope_freqs and rope scaling {scaling!r}; cannot combine them")
        factors = ckpt.read_tensor("rope_freqs.weight").float().numpy().astype(np.float64)
        params.update(llama3_rope_from_factors(factors, theta, head_dim, str(ckpt.path)))
    return params


def llama3_inv_freq(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """Inverse frequencies of llama3 rope, as transformers' _compute_llama3_parameters computes them."""
    base = 1.0 / (params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / base
    old, lo, hi = params["original_max_position_embeddings"], params["low_freq_factor"], params["high_freq_factor"]
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * base / params["factor"] + smooth * base
    out = np.where(wavelen > old / lo, base / params["factor"], base)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, out)


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int, where: str) -> dict[str, Any]:
    """Recover HF llama3 rope parameters from llama.cpp's per-frequency divisors (rope_freqs).

    The divisors fix only old_context/low_freq_factor and old_context/high_freq_factor, so
    original_max_position_embeddings is taken as 8192 (what convert_hf_to_gguf assumes).
    """
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"{where}: rope_freqs has shape {factors.shape}, expected ({head_dim // 2},)")
    if np.allclose(factors, 1.0):
        return {}
    old = 8192
    base = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / base  # increasing
    factor = float(factors.max())
    params: dict[str, Any] = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                              "original_max_position_embeddings": old, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0}
    if _matches(params, factors, base, head_dim):
        return params
    is_one = np.isclose(factors, 1.0, rtol=1e-6)
    is_max = np.isclose(factors, factor, rtol=1e-6)
    mid = ~is_one & ~is_max
    if mid.sum() >= 2:
        # 1/f = (1 - s)/factor + s with s linear in 1/wavelen: s = (old/w - lo) / (hi - lo).
        s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(1.0 / wavelen[mid], s, 1)
        high_wl, low_wl = slope / (1.0 - intercept), slope / -intercept
    else:
        # At most one smoothed value: put both thresholds around it, between its neighbours.
        last_one = wavelen[is_one].max() if is_one.any() else wavelen[0] / 2
        first_max = wavelen[is_max].min()
        if mid.any():
            w = float(wavelen[mid][0])
            s = (1.0 / float(factors[mid][0]) - 1.0 / factor) / (1.0 - 1.0 / factor)
            eps = min(1.0 / last_one - 1.0 / w, 1.0 / w - 1.0 / first_max) / 2
            high_wl, low_wl = 1.0 / (1.0 / w + (1 - s) * eps), 1.0 / (1.0 / w - s * eps)
        else:
            high_wl, low_wl = last_one + (first_max - last_one) / 3, last_one + 2 * (first_max - last_one) / 3
    params.update(low_freq_factor=float(old / low_wl), high_freq_factor=float(old / high_wl))
    if not _matches(params, factors, base, head_dim):
        raise ModelLoadError(
            f"{where}: rope_freqs does not follow the llama3 rope formula; cannot express it as a "
            "Hugging Face rope configuration"
        )
    return params


def _matches(params: dict[str, Any], factors: np.ndarray, base: np.ndarray, head_dim: int) -> bool:
    return bool(np.allclose(base / llama3_inv_freq(params, head_dim), factors, rtol=1e-4, atol=0))

"""Llama-family decoder: Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Parameters carry Hugging Face names except two fused projections (qkv_proj, gate_up_proj);
`load_weights` maps checkpoint names onto them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ModelLoadError
from tokenmill.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.quantization import QuantizationConfig, Unquantized
from tokenmill.quantization.weight_loading import whole_loader

# checkpoint projection -> (fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# FP8 KV-cache scales as FP8 checkpoints name them: `<layer>.self_attn.k_scale` (compressed-tensors),
# `.self_attn.attn.k_scale` (vLLM), `.self_attn.k_proj.k_scale` (ModelOpt), `.self_attn.kv_scale`
# (older: one scale for both), `.self_attn.k_proj.output_scale` (older compressed-tensors).
_KV_SCALE = re.compile(r"(?P<attn>.+\.self_attn)\.(?:attn\.|[kv]_proj\.)?(?P<which>k|v|kv)_scale")
_KV_OUTPUT_SCALE = re.compile(r"(?P<attn>.+\.self_attn)\.(?P<which>k|v)_proj\.output_scale")
# Scales of FP8 attention (query, probabilities): tokenmill quantizes only the KV cache.
_UNUSED_SCALE = re.compile(r".+\.self_attn\.(?:attn\.)?(?:q|prob)_scale")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Variant:
    """What sets an architecture of the family apart, beyond its config numbers."""

    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    qkv_bias: bool | None = None  # Qwen2: always; None = config.attention_bias
    o_bias: bool | None = None  # Qwen2: never; None = config.attention_bias


class Attention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: AttentionBackend, variant: Variant, fused: bool,
        quant: QuantizationConfig, prefix: str,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = bias if variant.o_bias is None else variant.o_bias
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias,
                               method=quant.linear_method(f"{prefix}.qkv_proj"))
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias, method=quant.linear_method(f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused) if variant.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.kv_cache = torch.empty(0)  # bound by the model runner
        self.k_scale = self.v_scale = 1.0  # FP8 KV scales (stored value = k / k_scale)
        # (k_scale, v_scale) as the checkpoint gives them; the runner applies them to an FP8 cache only.
        self.checkpoint_kv_scales: tuple[float, float] | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary.fused and self.backend.attends_prewritten_cache:
            # One kernel rotates q and writes the rotated k and v into the cache (saves a launch per layer).
            self.rotary.rotate_into_cache(positions, q, k, v, self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
            out = self.backend.attend(q, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale)
        else:
            q, k = self.rotary(positions, q, k)
            out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, fused: bool, quant: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.fused = fused
        size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, [size, size], bias=bias,
                                   method=quant.linear_method(f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(size, config.hidden_size, bias=bias, method=quant.linear_method(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from tokenmill.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: AttentionBackend, variant: Variant, fused: bool,
        quant: QuantizationConfig, prefix: str,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = Attention(config, rotary, backend, variant, fused, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = MLP(config, fused, quant, f"{prefix}.mlp")

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, not yet added to the residual stream (None at the start)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int, variant: Variant, fused: bool,
        quant: QuantizationConfig,
    ) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, fused)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, backend, variant, fused, quant, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, metadata)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Also Mistral (the same graph); Qwen2 and Qwen3 differ only in their Variant."""

    variant = Variant()

    def __init__(
        self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int, fused_ops: bool = False,
        quant: QuantizationConfig | None = None,
    ) -> None:
        """fused_ops: Triton kernels for RMSNorm (+ residual), rotary, SiLU-and-mul and few-row matmuls (CUDA)."""
        super().__init__()
        self.config = config
        quant = quant or Unquantized(fused_ops)
        self.model = DecoderModel(config, backend, max_positions, self.variant, fused_ops, quant)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, method=quant.linear_method("lm_head"))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        kv_scales: dict[str, dict[str, float]] = {}
        for name, tensor in weights:
            if "rotary_emb" in name or _UNUSED_SCALE.fullmatch(name):
                continue
            match = _KV_SCALE.fullmatch(name) or _KV_OUTPUT_SCALE.fullmatch(name)
            if match:
                which = match["which"]
                for kind in ("k", "v") if which == "kv" else (which,):
                    kv_scales.setdefault(match["attn"], {})[kind] = _kv_scale_value(name, tensor)
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = self._locate(name)
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target]
            try:
                getattr(param, "weight_loader", whole_loader)(param, tensor, shard)
            except ModelLoadError as error:
                raise ModelLoadError(f"{name}: {error}") from None
            loaded.add((target, shard))
        expected = {(n, s) for n, p in params.items() for s in (getattr(p, "shards", None) or [None])}
        missing = sorted(f"{n}:{s}" for n, s in expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        self._set_kv_scales(kv_scales)

    def _set_kv_scales(self, scales: dict[str, dict[str, float]]) -> None:
        """Record the checkpoint's FP8 KV scales on each layer's attention; they take effect only
        when a runner with an FP8 cache copies them to k_scale / v_scale."""
        for path, given in scales.items():
            try:
                attention = self.get_submodule(path)
            except AttributeError:
                attention = None
            if not isinstance(attention, Attention):
                raise ModelLoadError(f"checkpoint KV scales for {path!r} have no attention layer in {type(self).__name__}")
            if set(given) != {"k", "v"}:
                raise ModelLoadError(f"{path}: the checkpoint has a {next(iter(given))}_scale but no "
                                     f"{'v' if 'k' in given else 'k'}_scale; FP8 KV needs both")
            attention.checkpoint_kv_scales = (given["k"], given["v"])

    def _locate(self, name: str) -> tuple[str, int | None]:
        """(model parameter, shard of a fused projection or None) of a checkpoint tensor."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _FUSED:
                parts[i], shard = _FUSED[part]
                return ".".join(parts), shard
        return name, None


def _kv_scale_value(name: str, tensor: torch.Tensor) -> float:
    """A checkpoint scale as a float; a per-head scale becomes its largest, so no head saturates."""
    if tensor.numel() == 0:
        raise ModelLoadError(f"{name}: an empty KV scale tensor")
    value = float(tensor.float().max())
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{name}: KV scale {value} must be finite and positive")
    return value


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = Variant(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = Variant(qk_norm=True)

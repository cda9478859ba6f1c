"""Rotary position embedding (rotate-half layout) with the scaling types transformers defines."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.errors import ConfigError


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (computed on the CPU whatever device a model is built on, the meta device
    included) and the cos/sin scaling factor, from the model's rope parameters."""
    with torch.device("cpu"):
        return _rope_inv_freq(config, head_dim)


def _rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ConfigError(f"rope type {rope_type!r} is not supported (default, linear, llama3, yarn are)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """`use_triton` rotates q and k in place with the Triton kernel (CUDA only). `rotary_dim` below
    the head size rotates only the first rotary_dim channels of each head (partial rotary)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, use_triton: bool = False,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.use_triton = use_triton
        self.rotary_dim = rotary_dim or head_dim
        device = torch.empty(0).device  # where the model is being built
        inv_freq, scaling = rope_inv_freq(config, self.rotary_dim)
        # float32 throughout, exactly as transformers computes it.
        inv_freq = inv_freq.to(device)
        freqs = torch.arange(max_positions, dtype=torch.float, device=device)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", (torch.cat((freqs, freqs), -1).cos() * scaling), persistent=False)
        self.register_buffer("sin", (torch.cat((freqs, freqs), -1).sin() * scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self.rotary_dim
        if self.use_triton:
            from tokenmill.kernels.rotary import apply_rotary_

            if rot < q.shape[-1]:  # in place on the rotated channels' views
                apply_rotary_(positions, q[..., :rot], k[..., :rot], self.cos, self.sin)
                return q, k
            return apply_rotary_(positions, q, k, self.cos, self.sin)
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at positions [T], a new tensor (the PyTorch path)."""
        rot = self.rotary_dim
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        if rot < x.shape[-1]:
            return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        return _rotate(x, cos, sin)

    def rotate_into_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
        """Fused path (CUDA): rotate q in place and write rotated k and v into the paged cache."""
        from tokenmill.kernels.rotary import rotate_and_cache_

        if self.rotary_dim < q.shape[-1]:
            raise ValueError("the fused rotary cache write rotates whole heads; partial rotary takes the unfused path")

        return rotate_and_cache_(positions, q, k, v, self.cos, self.sin, kv_cache, slot_mapping, k_scale, v_scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

"""Rotary embedding of MLA's rope_dim-wide query and key part (see tokenmill.layers.attention.mla
for the styles each model uses). Rotation runs in float32 and rounds to the input dtype once; cos
and sin are computed from the positions each call, as transformers computes them."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.rotary import rope_inv_freq

RopeStyle = Literal["interleaved", "neox"]


def rotate_pe(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
              interleaved: bool) -> torch.Tensor:
    """x [T, ..., rope_dim] rotated at positions [T]. Frequency i turns the pair (x[2i], x[2i+1])
    when interleaved, else (x[i], x[i + rope_dim / 2]); the result holds all first elements,
    then all second ones."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[1],)
    cos = (freqs.cos() * attention_factor).view(shape)
    sin = (freqs.sin() * attention_factor).view(shape)
    h = x.float()
    x1, x2 = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MLARotary(nn.Module):
    def __init__(self, config: PretrainedConfig, rope_dim: int, style: RopeStyle) -> None:
        super().__init__()
        if style not in ("interleaved", "neox"):
            raise ConfigError(f"MLA rope style {style!r} is not one of 'interleaved', 'neox'")
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("rope_type", "default") != "default" and getattr(config, "head_dim", rope_dim) != rope_dim:
            raise ConfigError(f"the config's head_dim ({config.head_dim}) must be qk_rope_head_dim ({rope_dim}) for "
                              "its scaled rope")
        inv_freq, self.attention_factor = rope_inv_freq(config, rope_dim)
        self.interleaved = style == "interleaved"
        self.register_buffer("inv_freq", inv_freq.to(torch.empty(0).device), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return rotate_pe(x, positions, self.inv_freq, self.attention_factor, self.interleaved)

"""Kimi Delta Attention (KDA, Kimi-Linear): Gated DeltaNet with a forget gate per key channel.

    q, k, v = q_proj(x), k_proj(x), v_proj(x)                         H heads of D each (as many value heads)
    q, k, v = silu(causal depthwise conv1d(q | k | v))                 conv window kept per request
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)     [T, H, D] float32: one log-decay per key channel
    beta = sigmoid(b_proj(x))                                          [T, H]
    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t / sqrt(D)   (q, k L2-normalised)
    out = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))

The conv, the delta rule, the state spec and the per-forward slot layout are Gated DeltaNet's
(state.py's `short_conv_delta_rule` and `conv_delta_spec`; the kernels take the per-channel g).
Projections reading x are fused: `qkv_proj` (q_proj | k_proj | v_proj, the conv's input as is)
and `fgb_proj` (f_a_proj | g_a_proj | b_proj). The conv weight loads whole (`conv1d.weight`
[3 H D, 1, K], transformers' layout) or as the original checkpoint's `q_conv1d`, `k_conv1d`,
`v_conv1d` shards; `A_log` of any shape with H elements ([1, 1, H, 1] in checkpoints).
`KDA_PACKED` maps the checkpoint's names, relative to the layer's module (`linear_attn.`), for
models/weights.py's `load_checkpoint`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kv.specs import RecurrentStateSpec
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_attention.state import (
    DELTA_STATE,
    DeltaHeads,
    RecurrentBatch,
    conv_delta_spec,
    short_conv_delta_rule,
)
from tokenmill.layers.norm import GatedRMSNorm
from tokenmill.quantization.base import QuantizationConfig, Shard, set_weight_loader
from tokenmill.quantization.weight_loading import copy_checked, output_rows_loader

CONV_STATE = "conv"

# checkpoint name (under the layer's `linear_attn.`) -> (fused parameter, shard)
KDA_PACKED: dict[str, tuple[str, int | str | None]] = {
    "linear_attn.q_proj": ("linear_attn.qkv_proj", 0),
    "linear_attn.k_proj": ("linear_attn.qkv_proj", 1),
    "linear_attn.v_proj": ("linear_attn.qkv_proj", 2),
    "linear_attn.q_conv1d": ("linear_attn.conv1d", 0),
    "linear_attn.k_conv1d": ("linear_attn.conv1d", 1),
    "linear_attn.v_conv1d": ("linear_attn.conv1d", 2),
    "linear_attn.f_a_proj": ("linear_attn.fgb_proj", 0),
    "linear_attn.g_a_proj": ("linear_attn.fgb_proj", 1),
    "linear_attn.b_proj": ("linear_attn.fgb_proj", 2),
}


def reshaped_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
    """One checkpoint tensor with the parameter's element count fills it, in the parameter's shape."""
    if shard is not None:
        raise ModelLoadError(f"shard {shard} of a parameter that takes one checkpoint tensor")
    if tensor.numel() != param.numel():
        raise ModelLoadError(f"checkpoint shape {tuple(tensor.shape)} does not hold the {param.numel()} values of "
                             f"model shape {tuple(param.shape)}")
    copy_checked(param.data, tensor.reshape(param.shape))


class KimiDeltaAttention(nn.Module):
    """A cache layer: its state spec is one conv window over q | k | v and the delta-rule state
    [H, D, D]; forward(x [T, hidden], batch) -> [T, hidden]."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_width: int, eps: float, prefix: str,
                 quant: QuantizationConfig, *, state_dtype: torch.dtype, use_triton: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.heads = DeltaHeads(num_heads, head_dim, num_heads, head_dim)
        self.width = width = num_heads * head_dim
        self.conv_dim = self.heads.conv_dim
        self.use_triton = use_triton

        def linear(name: str, in_features: int, out_features: int | list[int]) -> Linear:
            return Linear(in_features, out_features, bias=False, method=quant.linear_method(f"{prefix}.{name}"))

        self.qkv_proj = linear("qkv_proj", hidden_size, [width, width, width])
        self.fgb_proj = linear("fgb_proj", hidden_size, [head_dim, head_dim, num_heads])
        self.f_b_proj = linear("f_b_proj", head_dim, width)
        self.g_b_proj = linear("g_b_proj", head_dim, width)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim, bias=False)
        self.conv1d.weight.requires_grad_(False)
        set_weight_loader(self.conv1d.weight, output_rows_loader([width] * 3, _conv_rows), shards=[0, 1, 2])
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32), requires_grad=False)
        self.A_log = set_weight_loader(nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False),
                                       reshaped_loader)
        self.o_norm = GatedRMSNorm(head_dim, eps, "sigmoid")
        self.o_proj = linear("o_proj", width, hidden_size)
        self.spec = conv_delta_spec({CONV_STATE: (conv_width, self.conv_dim)}, torch.get_default_dtype(), num_heads,
                                    head_dim, head_dim, state_dtype)
        self.conv_state = self.delta_state = torch.empty(0)  # bound by the runner

    def cache_spec(self) -> RecurrentStateSpec:
        return self.spec

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.conv_state, self.delta_state = cache[CONV_STATE], cache[DELTA_STATE]

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """The per-channel log-decay g [T, H, D] (float32) from f_a_proj's output f [T, D]."""
        gate = (self.f_b_proj(f).float() + self.dt_bias).view(f.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().exp()[:, None] * F.softplus(gate)

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        tokens = x.shape[0]
        f, gate, b = self.fgb_proj(x).split([self.head_dim, self.head_dim, self.num_heads], dim=-1)
        out = short_conv_delta_rule(self.qkv_proj(x), self.conv1d.weight.squeeze(1), self.conv_state, self.delta_state,
                                    self.heads, self.decay(f), b.sigmoid(), batch, self.use_triton)
        gate = self.g_b_proj(gate).view(tokens, self.num_heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(tokens, self.width))


def _conv_rows(tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """A conv weight stored [C, K] or [C, 1, K] in the rows' shape [C, 1, K]."""
    return tensor.reshape(dest.shape) if tensor.numel() == dest.numel() else tensor

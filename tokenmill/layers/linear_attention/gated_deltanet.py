"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the linear-attention token mixer of the hybrids.

    q, k, v, z, b, a = projections of x
    q, k, v = silu(causal depthwise conv1d(q | k | v))      conv window kept per request
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)       (float32)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T   per value head, q/k L2-normalised
    o_t = S_t^T q_t / sqrt(d_k);   out = out_proj(rmsnorm(o) * w * silu(z))   (Qwen4Exp: or sigmoid(z))

Value head h reads key head h // (n_v / n_k). Two projection layouts load into the same fused
parameters: Qwen3.5's separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (shards of
`in_proj_qkvz` and `in_proj_ba`, contiguous q | k | v | z) and Qwen3-Next's `in_proj_qkvz`,
`in_proj_ba` grouped per key head ([n_k, 2 d_k + 2 d_v n_v / n_k] and [n_k, 2 n_v / n_k]),
ungrouped in the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
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
from tokenmill.quantization.base import QuantizationConfig

CONV_STATE = "conv"

# checkpoint projection -> (fused parameter, shard): Qwen3.5's separate projections
PACKED: dict[str, tuple[str, int | str | None]] = {
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


class GatedDeltaNet(nn.Module):
    """A cache layer: its state spec is one conv window over q | k | v and the delta-rule state."""

    def __init__(self, config: PretrainedConfig, prefix: str, quant: QuantizationConfig, *, grouped_projections: bool,
                 state_dtype: torch.dtype, use_triton: bool = False, output_gate: str = "silu") -> None:
        """output_gate: the gated output norm's activation (silu; Qwen4Exp's output_gate_type may be sigmoid)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"Gated DeltaNet convolves with SiLU; hidden_act {config.hidden_act!r} is not supported")
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"linear_num_value_heads {self.num_v_heads} must be a multiple of linear_num_key_heads "
                              f"{self.num_k_heads}")
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.heads = DeltaHeads(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        self.conv_dim = self.heads.conv_dim
        self.conv_width = config.linear_conv_kernel_dim
        self.grouped_projections = grouped_projections
        self.use_triton = use_triton
        hidden = config.hidden_size
        self.in_proj_qkvz = Linear(hidden, [self.conv_dim, self.value_dim], bias=False,
                                   method=quant.linear_method(f"{prefix}.in_proj_qkvz"))
        self.in_proj_ba = Linear(hidden, [self.num_v_heads, self.num_v_heads], bias=False,
                                 method=quant.linear_method(f"{prefix}.in_proj_ba"))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, output_gate)
        self.out_proj = Linear(self.value_dim, hidden, bias=False, method=quant.linear_method(f"{prefix}.out_proj"))
        self.spec = conv_delta_spec({CONV_STATE: (self.conv_width, self.conv_dim)}, torch.get_default_dtype(),
                                    self.num_v_heads, self.head_k_dim, self.head_v_dim, state_dtype)
        self.conv_state = self.delta_state = torch.empty(0)  # bound by the runner

    def cache_spec(self) -> RecurrentStateSpec:
        return self.spec

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.conv_state, self.delta_state = cache[CONV_STATE], cache[DELTA_STATE]

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q | k | v [T, conv_dim], z [T, n_v, d_v], b [T, n_v], a [T, n_v]) in the contiguous layout."""
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        tokens = x.shape[0]
        if not self.grouped_projections:
            mixed, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
            b, a = ba.split(self.num_v_heads, dim=-1)
            return mixed, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b, a
        per_group = self.num_v_heads // self.num_k_heads
        groups = qkvz.view(tokens, self.num_k_heads, -1)
        q, k, v, z = groups.split([self.head_k_dim, self.head_k_dim, per_group * self.head_v_dim,
                                   per_group * self.head_v_dim], dim=-1)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        b, a = ba.view(tokens, self.num_k_heads, 2 * per_group).split(per_group, dim=-1)
        return (mixed, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b.reshape(tokens, -1),
                a.reshape(tokens, -1))

    def forward(self, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        tokens = x.shape[0]
        mixed, z, b, a = self._split(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = short_conv_delta_rule(mixed, self.conv1d.weight.squeeze(1), self.conv_state, self.delta_state, self.heads,
                                    g, beta, batch, self.use_triton)
        return self.out_proj(self.norm(out, z).reshape(tokens, self.value_dim))

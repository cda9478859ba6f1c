"""A sparse MoE block: router, routed experts, optional shared expert; output = routed + shared.

Built from a Qwen2-MoE, Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3 or Kimi-Linear config. Its
parameters keep the checkpoints' names where they can; `PACKED` maps the others (names relative
to the block, after `model.layers.{i}.mlp.`, or Kimi's and Mixtral's `.block_sparse_moe.`) for
models/weights.py's `load_checkpoint`:

    checkpoint                                   block
    gate.weight                                  gate.weight                  [E, H]
    gate.e_score_correction_bias                 gate.e_score_correction_bias [E], float32
    experts.{i}.gate_proj.weight | .w1.weight    experts.w13[i, :I]           shard (i, "gate")
    experts.{i}.up_proj.weight   | .w3.weight    experts.w13[i, I:]           shard (i, "up")
    experts.{i}.down_proj.weight | .w2.weight    experts.w2[i]                shard (i, "down")
    experts.gate_up_proj  (transformers 5)       experts.w13                  [E, 2I, H]
    experts.down_proj     (transformers 5)       experts.w2                   [E, H, I]
    experts.{i}.gate_proj.weight_scale (etc.)    experts.w13_weight_scale     shard (i, "gate"), and
                                                 so on for each name in QUANTIZED_SUFFIXES
    shared_expert(s).gate_proj.{weight,bias}     shared_expert.gate_up_proj.* shard 0
    shared_expert(s).up_proj.{weight,bias}       shared_expert.gate_up_proj.* shard 1
    shared_expert(s).down_proj.{weight,bias}     shared_expert.down_proj.*
    shared_expert_gate.weight                    shared_expert_gate.weight    [1, H]

Qwen2-MoE and Qwen3-Next have one shared expert of shared_expert_intermediate_size, gated per
token by sigmoid(shared_expert_gate(x)); DeepSeek and Kimi have n_shared_experts ungated ones,
one MLP of n_shared_experts * moe_intermediate_size.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.layers.moe.routing import RoutingConfig, select_experts
from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.unquantized import Unquantized
from tokenmill.quantization.weight_loading import QUANTIZED_SUFFIXES

_EXPERT_PROJECTIONS = {"gate": ("w13", ("gate_proj", "w1")), "up": ("w13", ("up_proj", "w3")),
                       "down": ("w2", ("down_proj", "w2"))}
PACKED: dict[str, tuple[str, int | str | None]] = {
    **{f"experts.*.{proj}.weight": (f"experts.{stack}", shard)
       for shard, (stack, names) in _EXPERT_PROJECTIONS.items() for proj in names},
    **{f"experts.*.{proj}.{suffix}": (f"experts.{stack}_{suffix}", shard)
       for shard, (stack, names) in _EXPERT_PROJECTIONS.items() for proj in names for suffix in QUANTIZED_SUFFIXES},
    "experts.gate_up_proj": ("experts.w13", None),
    "experts.down_proj": ("experts.w2", None),
    "shared_experts": ("shared_expert", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RouterGate(Linear):
    """Router logits, float32 [T, E]; the matmul in float32 when the weight is (float32_logits)."""

    def __init__(self, hidden_size: int, routing: RoutingConfig, method: LinearMethod) -> None:
        dtype = torch.float32 if routing.float32_logits else None
        super().__init__(hidden_size, routing.num_experts, bias=False, method=method, dtype=dtype)
        if routing.has_correction_bias:
            bias = torch.zeros(routing.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).float()


class SparseMoeBlock(nn.Module):
    PACKED = PACKED

    def __init__(self, config: PretrainedConfig, prefix: str = "mlp", *, quant: QuantizationConfig | None = None,
                 use_triton: bool = False) -> None:
        """prefix: the block's module path (the quantization config picks its layers' methods by it);
        use_triton: the Triton kernels for routing, experts and the shared expert (CUDA models)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"MoE experts use SiLU-and-mul; hidden_act {config.hidden_act!r} is not supported")
        quant = quant or Unquantized(use_triton)
        self.use_triton = use_triton
        self.routing = RoutingConfig.from_hf_config(config)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.hidden_size = hidden
        self.gate = RouterGate(hidden, self.routing, quant.linear_method(f"{prefix}.gate"))
        self.experts = FusedMoE(self.routing.num_experts, hidden, inter, method=quant.experts_method(f"{prefix}.experts"))
        gated_size = getattr(config, "shared_expert_intermediate_size", None) or 0
        ungated_count = getattr(config, "n_shared_experts", None) or 0
        shared_size = gated_size or ungated_count * inter
        bias = bool(getattr(config, "mlp_bias", False))
        self.shared_expert = (GatedMLP(hidden, shared_size, bias, quant, f"{prefix}.shared_expert", use_triton)
                              if shared_size else None)
        self.shared_expert_gate = (Linear(hidden, 1, bias=False, method=quant.linear_method(f"{prefix}.shared_expert_gate"))
                                   if gated_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        flat = x.reshape(-1, self.hidden_size)
        weights, ids = select_experts(self.gate(flat), self.routing, self.gate.e_score_correction_bias,
                                      use_triton=self.use_triton)
        shared = self.shared_expert(flat) if self.shared_expert is not None else None
        shared_gate = self.shared_expert_gate(flat) if self.shared_expert_gate is not None else None
        return self.experts(flat, weights, ids, shared, shared_gate).view(x.shape)

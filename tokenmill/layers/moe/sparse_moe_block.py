"""A sparse MoE block: router, routed experts, optional shared expert; output = routed + shared.

Built from a Qwen2-MoE, Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3 or Kimi-Linear config. Its
parameters keep the checkpoints' names where they can; `load_weight` takes a checkpoint name
relative to the block (after `model.layers.{i}.mlp.`, or Kimi's and Mixtral's
`.block_sparse_moe.`):

    checkpoint                                   block
    gate.weight                                  gate.weight                  [E, H]
    gate.e_score_correction_bias                 gate.e_score_correction_bias [E], float32
    experts.{i}.gate_proj.weight | .w1.weight    experts.w13[i, :I]
    experts.{i}.up_proj.weight   | .w3.weight    experts.w13[i, I:]
    experts.{i}.down_proj.weight | .w2.weight    experts.w2[i]
    experts.gate_up_proj  (transformers 5)       experts.w13                  [E, 2I, H]
    experts.down_proj     (transformers 5)       experts.w2                   [E, H, I]
    shared_expert(s).gate_proj.{weight,bias}     shared_expert.gate_up_proj.*[:Is]
    shared_expert(s).up_proj.{weight,bias}       shared_expert.gate_up_proj.*[Is:]
    shared_expert(s).down_proj.{weight,bias}     shared_expert.down_proj.*
    shared_expert_gate.weight                    shared_expert_gate.weight    [1, H]

Qwen2-MoE and Qwen3-Next have one shared expert of shared_expert_intermediate_size, gated per
token by sigmoid(shared_expert_gate(x)); DeepSeek and Kimi have n_shared_experts ungated ones,
one MLP of n_shared_experts * moe_intermediate_size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.layers.moe.routing import RoutingConfig, select_experts


class RouterGate(Linear):
    """Router logits, float32 [T, E]; the matmul in float32 when the weight is (float32_logits)."""

    e_score_correction_bias: torch.Tensor | None

    def __init__(self, hidden_size: int, routing: RoutingConfig, fused: bool) -> None:
        dtype = torch.float32 if routing.float32_logits else None
        super().__init__(hidden_size, routing.num_experts, bias=False, few_row_kernel=fused, dtype=dtype)
        bias = torch.zeros(routing.num_experts, dtype=torch.float32) if routing.has_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).float()


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, few_row_kernel=fused)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, few_row_kernel=fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            from tokenmill.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, fused: bool = False) -> None:
        """fused: the Triton kernels for routing, experts and the shared expert (CUDA models)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"MoE experts use SiLU-and-mul; hidden_act {config.hidden_act!r} is not supported")
        self.fused = fused
        self.routing = RoutingConfig.from_hf_config(config)
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.hidden_size = hidden
        self.gate = RouterGate(hidden, self.routing, fused)
        self.experts = FusedMoE(self.routing.num_experts, hidden, inter, fused)
        gated_size = getattr(config, "shared_expert_intermediate_size", None) or 0
        ungated_count = getattr(config, "n_shared_experts", None) or 0
        shared_size = gated_size or ungated_count * inter
        bias = bool(getattr(config, "mlp_bias", False))
        self.shared_expert = SharedExpert(hidden, shared_size, bias, fused) if shared_size else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False, few_row_kernel=fused) if gated_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]."""
        flat = x.reshape(-1, self.hidden_size)
        weights, ids = select_experts(self.gate(flat), self.routing, self.gate.e_score_correction_bias,
                                      use_triton=self.fused)
        shared = self.shared_expert(flat) if self.shared_expert is not None else None
        shared_gate = self.shared_expert_gate(flat) if self.shared_expert_gate is not None else None
        return self.experts(flat, weights, ids, shared, shared_gate).view(x.shape)

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy one checkpoint tensor (name relative to the block) in; returns the slots it filled."""
        if name.startswith("experts."):
            target = FusedMoE.checkpoint_target(name.removeprefix("experts."))
            if target is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the experts")
            param, expert, shard = target
            self.experts.weight_loader(param, tensor, expert, shard)
            experts = range(self.routing.num_experts) if expert is None else (expert,)
            shards = ("gate", "up") if param == "w13" else ("down",)
            return [_expert_slot(param, e, s) for e in experts for s in (shards if shard is None else (shard,))]
        for prefix in ("shared_expert.", "shared_experts."):
            if name.startswith(prefix) and self.shared_expert is not None:
                return [self._load_shared(name.removeprefix(prefix), tensor)]
        own = dict(self.named_parameters()) | {k: v for k, v in self.named_buffers() if v is not None}
        if name not in own or name.startswith("shared_expert."):
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        _copy(own[name], tensor, name)
        return [name]

    def _load_shared(self, name: str, tensor: torch.Tensor) -> str:
        proj, _, kind = name.partition(".")
        mlp = self.shared_expert
        if proj in ("gate_proj", "up_proj") and kind in ("weight", "bias"):
            inter = mlp.intermediate_size
            param = getattr(mlp.gate_up_proj, kind)
            dest = param[:inter] if proj == "gate_proj" else param[inter:]
        elif proj == "down_proj" and kind in ("weight", "bias"):
            dest = getattr(mlp.down_proj, kind)
        else:
            dest = None
        if dest is None:
            raise ModelLoadError(f"checkpoint tensor shared_expert.{name!r} has no place in the shared expert")
        _copy(dest, tensor, f"shared_expert.{name}")
        return f"shared_expert.{name}"

    def expected_slots(self) -> set[str]:
        """Every slot a complete checkpoint fills (load_weight's return values)."""
        slots = {"gate.weight"}
        if self.gate.e_score_correction_bias is not None:
            slots.add("gate.e_score_correction_bias")
        for e in range(self.routing.num_experts):
            slots |= {_expert_slot("w13", e, "gate"), _expert_slot("w13", e, "up"), _expert_slot("w2", e, "down")}
        if self.shared_expert is not None:
            kinds = ("weight", "bias") if self.shared_expert.down_proj.bias is not None else ("weight",)
            slots |= {f"shared_expert.{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in kinds}
        if self.shared_expert_gate is not None:
            slots.add("shared_expert_gate.weight")
        return slots

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a whole block (names relative to it); a tensor without a place or a missing one raises."""
        filled: set[str] = set()
        for name, tensor in weights:
            filled.update(self.load_weight(name, tensor))
        missing = sorted(self.expected_slots() - filled)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors of the MoE block, e.g. {missing[:3]}")


def _expert_slot(param: str, expert: int, shard: str) -> str:
    return f"experts.{param}[{expert}].{shard}"


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dest.shape != tensor.shape:
        raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != block shape {tuple(dest.shape)}")
    dest.copy_(tensor)

"""load_checkpoint's packed names: fused projections by shard, stacked experts by (expert, projection),
renames, whole tensors filling every shard of a parameter, and exact missing / unplaced checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import PACKED as MOE_PACKED
from tokenmill.layers.moe import FusedMoE
from tokenmill.models.llama import PACKED
from tokenmill.models.weights import CheckpointLoader, load_checkpoint


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = Linear(8, [8, 4, 4], bias=False)
        self.experts = FusedMoE(3, 8, 4)


@pytest.mark.parametrize(
    "name,target,shard",
    [("model.layers.3.mlp.experts.12.up_proj.weight", "model.layers.3.mlp.experts.w13", (12, "up")),
     ("model.layers.3.block_sparse_moe.experts.0.w2.weight", "model.layers.3.block_sparse_moe.experts.w2", (0, "down")),
     ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.w13", None),
     ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.gate_up_proj.weight", 0),
     ("model.layers.3.mlp.shared_experts.up_proj.bias", "model.layers.3.mlp.shared_expert.gate_up_proj.bias", 1),
     ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.weight", None)],
)
def test_checkpoint_names_locate_their_parameter_and_shard(name: str, target: str, shard: object) -> None:
    assert CheckpointLoader(nn.Module(), {**PACKED, **MOE_PACKED}).locate(name) == (target, shard)


def test_a_name_matching_two_shards_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="matches two packed projections"):
        CheckpointLoader(nn.Module(), PACKED).locate("q_proj.up_proj.weight")


def test_whole_tensors_fill_every_shard_and_per_shard_ones_are_counted() -> None:
    toy = Toy()
    qkv = torch.randn(16, 8)
    per_expert = {f"experts.{e}.{p}.weight": torch.randn(4, 8) for e in range(3) for p in ("gate_proj", "up_proj")}
    load_checkpoint(toy, [("qkv_proj.weight", qkv), *per_expert.items(), ("experts.down_proj", torch.randn(3, 8, 4))],
                    MOE_PACKED)
    assert torch.equal(toy.qkv_proj.weight, qkv)
    assert torch.equal(toy.experts.w13[2, 4:], per_expert["experts.2.up_proj.weight"])
    with pytest.raises(ModelLoadError, match=r"lacks 2 tensors of Toy, e.g. \['experts.w13\[1\] gate', 'qkv_proj.weight:1'\]"):
        partial = [("q_proj.weight", qkv[:8]), ("v_proj.weight", qkv[12:]), ("experts.down_proj", torch.randn(3, 8, 4))]
        partial += [(k, v) for k, v in per_expert.items() if k != "experts.1.gate_proj.weight"]
        load_checkpoint(toy, partial, {**PACKED, **MOE_PACKED})

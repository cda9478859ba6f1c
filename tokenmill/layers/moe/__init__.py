"""Mixture-of-experts layers: routing (every router kind), the stacked routed experts, and the
sparse block that joins them with a shared expert. Imports no triton: the kernels are imported
when a layer with use_triton first runs."""

from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.layers.moe.routing import RoutingConfig, select_experts, select_experts_ref
from tokenmill.layers.moe.sparse_moe_block import PACKED, SparseMoeBlock
from tokenmill.quantization.unquantized_experts import fused_experts_ref

__all__ = ["PACKED", "FusedMoE", "RoutingConfig", "SparseMoeBlock", "fused_experts_ref", "select_experts",
           "select_experts_ref"]

"""Mixture-of-experts layers: routing (every router kind), the stacked routed experts, and the
sparse block that joins them with a shared expert. Imports no triton: the kernels are imported
when a fused layer first runs."""

from tokenmill.layers.moe.fused_moe import FusedMoE, fused_experts_ref
from tokenmill.layers.moe.routing import RoutingConfig, select_experts, select_experts_ref
from tokenmill.layers.moe.sparse_moe_block import SparseMoeBlock

__all__ = ["FusedMoE", "RoutingConfig", "SparseMoeBlock", "fused_experts_ref", "select_experts", "select_experts_ref"]

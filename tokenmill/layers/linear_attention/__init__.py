"""Linear-attention token mixers whose state lives in per-request slots (Gated DeltaNet)."""

from tokenmill.layers.linear_attention.gated_deltanet import PACKED, GatedDeltaNet
from tokenmill.layers.linear_attention.state import RecurrentBatch, conv_delta_spec

__all__ = ["PACKED", "GatedDeltaNet", "RecurrentBatch", "conv_delta_spec"]

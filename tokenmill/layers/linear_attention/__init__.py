"""Linear-attention token mixers whose state lives in per-request slots (Gated DeltaNet, KDA)."""

from tokenmill.layers.linear_attention.gated_deltanet import PACKED, GatedDeltaNet
from tokenmill.layers.linear_attention.kda import KDA_PACKED, KimiDeltaAttention
from tokenmill.layers.linear_attention.state import RecurrentBatch, conv_delta_spec

__all__ = ["KDA_PACKED", "PACKED", "GatedDeltaNet", "KimiDeltaAttention", "RecurrentBatch", "conv_delta_spec"]

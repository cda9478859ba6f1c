"""Attention backends, by name. `finalize` picks one; an unknown name fails at start-up."""

from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
    TritonAttentionBackend.name: TritonAttentionBackend,
}

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend", "TritonAttentionBackend"]

"""Attention backends, by name. `finalize` picks one; an unknown name fails at start-up."""

from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchReferenceBackend.name: TorchReferenceBackend,
}

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend"]

"""What every model is: built from a `ModelBuild`, a forward over a packed batch and its
`StepContext`, logits from hidden states, cache specs from its cache layers, and a checkpoint
loader driven by per-parameter weight loaders.

A new architecture is one file with a `CausalLM` subclass and one line in registry.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import CacheLayer, CacheSpec
from tokenmill.layers.attention import AttentionBackend
from tokenmill.layers.steering import ResidualSteering
from tokenmill.layers.step_context import RequestInputSpec, StepContext
from tokenmill.quantization import FusedMoEMethod, LinearMethod, QuantizationConfig, Unquantized
from tokenmill.quantization.kv_scales import ScaledCacheLayer


@dataclass(frozen=True)
class ModelBuild:
    """Everything a model's constructor needs besides its own config."""

    hf_config: PretrainedConfig
    attention_backend: AttentionBackend
    max_model_len: int
    block_size: int = 16
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype
    use_triton: bool = False  # the fused Triton kernels (CUDA) instead of the PyTorch reference ops
    quantization: QuantizationConfig | None = None  # None: unquantized
    state_dtype: torch.dtype = torch.float32  # recurrent (delta-rule / SSM) states; conv windows keep the model dtype

    @property
    def quant(self) -> QuantizationConfig:
        return self.quantization or Unquantized(self.use_triton)

    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or torch.get_default_dtype()


class CausalLM(nn.Module, ABC):
    """A decoder-only language model over tokenmill's packed batches."""

    def __init__(self, build: ModelBuild) -> None:
        super().__init__()
        self.config = build.hf_config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed tokens."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the given hidden-state rows."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a checkpoint's (name, tensor) pairs into the parameters; raise ModelLoadError on a
        tensor without a place or a parameter left unfilled."""

    def cache_layers(self) -> dict[str, CacheLayer]:
        """Every module that keeps a cache, by module path, in forward order."""
        return {name: m for name, m in self.named_modules() if name and isinstance(m, CacheLayer)}

    def scaled_cache_layers(self) -> list[ScaledCacheLayer]:
        """The cache layers whose cache may be FP8 with per-layer scales (`ScaledCacheLayer`)."""
        return [m for m in self.cache_layers().values() if hasattr(m, "checkpoint_kv_scales")]  # type: ignore[misc]

    def cache_specs(self) -> dict[str, CacheSpec]:
        return {name: layer.cache_spec() for name, layer in self.cache_layers().items()}

    @classmethod
    def serving_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        """The config the engine runs a checkpoint with: the config itself, or for a multimodal
        checkpoint served as text only, its text part."""
        return config

    def request_inputs(self) -> dict[str, RequestInputSpec]:
        """Per-request inputs this model reads from StepContext.request_inputs (none by default;
        a model with residual steering installed reads its strengths)."""
        steering = self.residual_steering
        return steering.request_inputs() if steering is not None else {}

    def token_outputs(self) -> tuple[str, ...]:
        """Per-token outputs the forward records into StepContext.outputs (steering's projection)."""
        steering = self.residual_steering
        return steering.token_outputs() if steering is not None else ()

    @property
    def residual_steering(self) -> ResidualSteering | None:
        return None

    def set_residual_steering(self, steering: ResidualSteering) -> None:
        """Ablate `steering`'s direction from every write into the residual stream with per-request
        strengths (layers/steering.py). A model routes its residual adds through
        `layers.steering.residual_add_norm` to support it; one that does not refuses here."""
        raise ConfigError(f"{type(self).__name__} does not support residual steering (--steering): its layers do not "
                          "route their residual writes through layers/steering.py; serve it without --steering")

    def process_weights_after_loading(self) -> None:
        """Let every quantization method finish its layers (e.g. quantize on load)."""
        for module in self.modules():
            method = getattr(module, "method", None)
            if isinstance(method, (LinearMethod, FusedMoEMethod)):
                method.process_weights_after_loading(module)  # type: ignore[arg-type]

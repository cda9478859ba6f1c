"""What every model is: built from a `ModelBuild`, a forward over a packed batch and its
`StepContext`, logits from hidden states, cache specs from its cache layers, and a checkpoint
loader driven by per-parameter weight loaders.

A new architecture is one file with a `CausalLM` subclass and one line in registry.py. A family
with a multi-token-prediction head (MTP) builds it in `CausalLM.mtp_head`, an `MTPHead` over the
target's own embedding and output head, run by tokenmill.speculative.mtp as a proposer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import CacheLayer, CacheSpec
from tokenmill.layers.attention import AttentionBackend, AttentionMetadata
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


class StepModel(nn.Module, ABC):
    """What a step runs (a target or a draft, eagerly or in a CUDA graph): a forward over a packed
    batch, logits of hidden-state rows, its cache layers and per-request inputs."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Hidden states [T, width] of the packed tokens."""

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
    def config_from_dict(cls, raw: dict) -> PretrainedConfig | None:
        """The config of a checkpoint whose config.json (`raw`) this class reads itself, failing
        closed on what it cannot run; None (the default): transformers' AutoConfig reads it."""
        return None

    @classmethod
    def serving_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        """The config the engine runs a checkpoint with: the config itself, or for a multimodal
        checkpoint served as text only, its text part."""
        return config

    def graph_plan_key(self, metadata: AttentionMetadata) -> Hashable:
        """What a CUDA graph captured over a uniform step's metadata depends on beyond its shapes:
        every host-side choice the forward makes from the host lengths (attention launch plans).
        Two context buckets of a batch bucket with equal keys share one graph. The default, the
        longest context itself, gives every bucket its own graph: a model overrides it only when
        the key holds every such choice."""
        return metadata.max_seq_len

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


MTP_HIDDEN = "mtp_hidden"
"""StepContext.token_inputs key of the hidden states an MTP head reads per row."""
MTP_PICK = "mtp_pick"
"""StepContext.request_inputs key of the row (within each request) whose output a head's step returns."""


class MTPHead(StepModel):
    """A target's multi-token-prediction layer: row p reads the token at p + 1 (`input_ids`) and a
    hidden state (`ctx.token_inputs[MTP_HIDDEN]`, [T, width]): the target's (`CausalLM.mtp_tap`)
    at p for a position the target computed, or, chained, the head's own output at p - 1. Its
    forward returns what the next chained step reads (`width` wide); `compute_logits` gives the
    logits of the token at p + 2. The embedding and the output head are the target's (shared, not
    its parameters) until a draft vocabulary gives it its own (`set_output_head`)."""

    width: int  # features of the hidden state it reads and returns, per row

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_embed_tokens", embed_tokens)  # shared with the target: not a submodule
        object.__setattr__(self, "_lm_head", lm_head)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        """The output head: the target's, or the head's own after `set_output_head`."""
        own = self._modules.get("own_lm_head")
        return self._lm_head if own is None else own

    def set_output_head(self, head: nn.Module) -> None:
        """Give the head an output head of its own (a restriction to a draft vocabulary)."""
        self.own_lm_head = head

    @abstractmethod
    def owns(self, name: str) -> bool:
        """Whether a checkpoint tensor (by its name in the target's checkpoint) is this head's."""

    def request_inputs(self) -> dict[str, RequestInputSpec]:
        return {MTP_PICK: RequestInputSpec((), torch.int64)}


class CausalLM(StepModel):
    """A decoder-only language model over tokenmill's packed batches."""

    def __init__(self, build: ModelBuild) -> None:
        super().__init__()
        self.config = build.hf_config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed tokens."""

    def mtp_head(self, build: ModelBuild) -> MTPHead:
        """This model's MTP head, constructed (not loaded); ConfigError where the family or the
        config has none."""
        raise ConfigError(f"{type(self).__name__} has no multi-token-prediction (MTP) head in tokenmill; "
                          "use the ngram or draft_model speculative method")

    def mtp_keep_hidden(self) -> tuple[int, ...]:
        """StepContext.keep_hidden entries the MTP tap needs the forward to record (none: the tap is
        the forward's output)."""
        return ()

    def mtp_tap(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The hidden states [T, width] the MTP head reads per row, from the forward's output (and
        ctx.hidden): by default the output itself (after the final norm, as vLLM and SGLang feed
        their MTP heads)."""
        return hidden

    def layer_output_entries(self, layer_ids: Sequence[int]) -> tuple[int, ...]:
        """StepContext.keep_hidden entries whose recordings are the outputs of these decoder layers
        (a block drafter's `target_layer_ids`): layer i's output is the residual stream entering
        layer i + 1, transformers' `hidden_states[i + 1]`. The last layer's output has no such
        entry (transformers reports it after the final norm), so it is refused, as any id outside
        the layers is."""
        layers = int(self.config.num_hidden_layers)
        bad = [i for i in layer_ids if not 0 <= int(i) < layers - 1]
        if bad:
            raise ConfigError(f"target_layer_ids {list(layer_ids)}: {bad} not among the layers whose outputs "
                              f"{type(self).__name__} records (0..{layers - 2} of its {layers} layers)")
        return tuple(int(i) + 1 for i in layer_ids)

    def layer_outputs(self, ctx: StepContext, layer_ids: Sequence[int]) -> torch.Tensor:
        """[T, len(layer_ids) * width]: the recorded outputs of these layers side by side, in order."""
        return torch.cat([ctx.hidden[int(i) + 1] for i in layer_ids], dim=-1)

    def layer_output_width(self) -> int:
        """Features of one recorded layer output per row."""
        return int(self.config.hidden_size)

    def input_embedding(self) -> nn.Embedding:
        """The token embedding (a block drafter embeds its block with the target's)."""
        found = [m for name, m in self.named_modules() if name.rsplit(".", 1)[-1] == "embed_tokens"
                 and isinstance(m, nn.Embedding)]
        if len(found) != 1:
            raise ConfigError(f"{type(self).__name__} has {len(found)} token embeddings named embed_tokens; "
                              "it must say which one a drafter shares (input_embedding)")
        return found[0]

    def output_head(self) -> nn.Module:
        """The output head (a block drafter shares the target's unless it has its own)."""
        head = getattr(self, "lm_head", None)
        if not isinstance(head, nn.Module):
            raise ConfigError(f"{type(self).__name__} has no lm_head a drafter could share (output_head)")
        return head

    @classmethod
    def serving_config(cls, config: PretrainedConfig) -> PretrainedConfig:
        """The config the engine runs a checkpoint with: the config itself, or for a multimodal
        checkpoint served as text only, its text part."""
        return config

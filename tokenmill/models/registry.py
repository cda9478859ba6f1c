"""Architecture name (config.architectures[0]) -> model class."""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenmill.errors import ModelLoadError
from tokenmill.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


# For configs without `architectures` (e.g. built from GGUF metadata).
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    architectures = getattr(config, "architectures", None) or [_BY_MODEL_TYPE.get(config.model_type, "")]
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ModelLoadError(
        f"unsupported architecture {architectures or config.model_type!r}; "
        f"tokenmill runs {', '.join(MODEL_REGISTRY)}"
    )

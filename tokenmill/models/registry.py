"""Architecture name (config.architectures[0]) -> model class, imported on first use."""

from __future__ import annotations

import importlib

from transformers import PretrainedConfig

from tokenmill.errors import ModelLoadError
from tokenmill.models.interface import CausalLM

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("tokenmill.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("tokenmill.models.deepseek", "DeepseekV3ForCausalLM"),
    "KimiLinearForCausalLM": ("tokenmill.models.kimi_linear", "KimiLinearForCausalLM"),
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.llama", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("tokenmill.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("tokenmill.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("tokenmill.models.qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("tokenmill.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("tokenmill.models.qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("tokenmill.models.qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
    "Qwen4ExpForCausalLM": ("tokenmill.models.qwen4_exp", "Qwen4ExpForCausalLM"),
    "Qwen4ExpForConditionalGeneration": ("tokenmill.models.qwen4_exp", "Qwen4ExpForConditionalGeneration"),
    "RaonForCausalLM": ("tokenmill.models.raon", "RaonForCausalLM"),
}

# For configs without `architectures` (e.g. built from GGUF metadata).
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                  "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                  "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen4_exp_text": "Qwen4ExpForCausalLM",
                  "qwen4_exp": "Qwen4ExpForConditionalGeneration", "kimi_linear": "KimiLinearForCausalLM",
                  "raon": "RaonForCausalLM"}


def register_model(architecture: str, module: str, class_name: str, model_type: str | None = None) -> None:
    """Make `architecture` (and optionally a config model_type) load `module.class_name`."""
    _MODELS[architecture] = (module, class_name)
    if model_type is not None:
        _BY_MODEL_TYPE[model_type] = architecture


def serving_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config the engine runs a checkpoint with (its model class's `serving_config`); an
    unsupported architecture is left for `model_class` to refuse."""
    try:
        cls = model_class(config)
    except ModelLoadError:
        return config
    return cls.serving_config(config)


def config_from_dict(raw: dict) -> PretrainedConfig | None:
    """The config a registered model class builds itself from config.json's dict (its
    `config_from_dict`: architectures transformers does not know, such as trust_remote_code
    checkpoints); None where the class leaves it to AutoConfig or no class is registered."""
    architectures = raw.get("architectures") or [_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")]
    for name in architectures:
        if name in _MODELS:
            module, class_name = _MODELS[name]
            cls = getattr(importlib.import_module(module), class_name)
            return cls.config_from_dict(raw) if isinstance(cls, type) and issubclass(cls, CausalLM) else None
    return None


def supported_architectures() -> list[str]:
    return list(_MODELS)


def model_class(config: PretrainedConfig) -> type[CausalLM]:
    architectures = getattr(config, "architectures", None) or [_BY_MODEL_TYPE.get(config.model_type, "")]
    for name in architectures:
        if name in _MODELS:
            module, class_name = _MODELS[name]
            cls = getattr(importlib.import_module(module), class_name)
            if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
                raise ModelLoadError(f"{module}.{class_name} (registered for {name}) is not a CausalLM")
            return cls
    raise ModelLoadError(
        f"unsupported architecture {architectures or config.model_type!r}; "
        f"tokenmill runs {', '.join(_MODELS)}"
    )

"""Reading a checkpoint's quantization from its config: config.json's `quantization_config` and
hf_quant_config.json, in each convention tokenmill knows, normalised to one `QuantSpec`:

- ModelOpt: hf_quant_config.json {"quantization": {"quant_algo", "exclude_modules",
  "quantized_layers" (MIXED_PRECISION), "group_size", "kv_cache_quant_algo"}}, or the same in
  config.json with quant_method "modelopt" ("ignore" for the exclusions).
- quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3, Qwen3-FP8): weight_block_size
  [128, 128] -> FP8_BLOCK with weight_scale_inv, else per-tensor FP8; activation_scheme
  "static" adds input scales; exclusions in modules_to_not_convert (or ignored_layers).
- compressed-tensors "float-quantized": one FP8 weight scheme over the Linear layers (strategy
  tensor -> FP8, channel -> FP8_PER_CHANNEL_PER_TOKEN, block -> FP8_BLOCK), exclusions in
  "ignore" ("re:" prefixes a regex).

Anything else fails closed here, naming the file, the field and its value. Which formats exist
is quantization/registry.py's FORMATS; an algorithm this build does not read is refused when
the checkpoint's CheckpointQuantization is built (quantization/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ConfigError

MIXED = "MIXED_PRECISION"
CONFIG_JSON = "config.json quantization_config"
HF_QUANT_CONFIG = "hf_quant_config.json quantization"


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization: `settings` of the one format of its quantized layers (None for
    MIXED_PRECISION, whose `layers` maps each quantized checkpoint module to its own settings), and
    `exclude`: checkpoint module patterns kept unquantized (fnmatch globs, or "re:" + a regex)."""

    settings: dict[str, Any] | None
    exclude: tuple[str, ...] = ()
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    where: str = CONFIG_JSON


def read_quant_spec(quantization_config: Mapping[str, Any] | None,
                    hf_quant_config: Mapping[str, Any] | None) -> QuantSpec | None:
    """The checkpoint's quantization, or None for an unquantized checkpoint. When both files
    describe it, they must agree on the algorithm."""
    if hf_quant_config and not isinstance(hf_quant_config.get("quantization"), Mapping):
        raise ConfigError("hf_quant_config.json has no \"quantization\" section; fix or remove the file")
    from_config = _from_config_json(quantization_config) if quantization_config else None
    from_file = _modelopt(hf_quant_config.get("quantization"), HF_QUANT_CONFIG) if hf_quant_config else None
    if from_config and from_file and _algo(from_config) != _algo(from_file):
        raise ConfigError(f"{CONFIG_JSON} says {_algo(from_config)} but {HF_QUANT_CONFIG} says {_algo(from_file)}; "
                          "the checkpoint's two configs disagree: fix or remove one of them")
    return from_config or from_file


def _algo(spec: QuantSpec) -> str:
    return MIXED if spec.settings is None else spec.settings["quant_algo"]


def _from_config_json(config: Mapping[str, Any]) -> QuantSpec:
    method = str(config.get("quant_method", "")).lower()
    if method.startswith("modelopt"):
        return _modelopt(config.get("quantization", config), CONFIG_JSON)
    if method == "fp8":
        return _fp8_method(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise ConfigError(f"{CONFIG_JSON}.quant_method = {config.get('quant_method')!r} is not supported; tokenmill "
                      "reads modelopt, fp8 and compressed-tensors (float-quantized FP8) checkpoints")


def _modelopt(section: Any, where: str) -> QuantSpec:
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} must be a JSON object")
    algo = str(section.get("quant_algo") or "").upper()
    if not algo:
        raise ConfigError(f"{where}.quant_algo is missing; a ModelOpt checkpoint names its algorithm there")
    exclude = tuple(section.get("exclude_modules", section.get("ignore")) or ())
    common = {"group_size": section["group_size"]} if "group_size" in section else {}
    if algo == "FP8_PB_WO":
        return QuantSpec({"quant_algo": "FP8_BLOCK", "weight_block_size": [128, 128], "scale_name": "weight_scale",
                          "where": f"{where}.quant_algo"}, exclude, where=where)
    if algo != MIXED:
        return QuantSpec({"quant_algo": algo, **common, "where": f"{where}.quant_algo"}, exclude, where=where)
    layers = section.get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise ConfigError(f"{where}.quant_algo = MIXED_PRECISION needs a non-empty quantized_layers map")
    return QuantSpec(None, exclude, {name: _layer_settings(name, entry, where, common) for name, entry in layers.items()},
                     where)


def _layer_settings(name: str, entry: Any, where: str, common: Mapping[str, Any]) -> dict[str, Any]:
    field_name = f"{where}.quantized_layers[{name!r}]"
    if not isinstance(entry, Mapping) or not entry.get("quant_algo"):
        raise ConfigError(f"{field_name} must be an object with a quant_algo")
    return {**common, **entry, "quant_algo": str(entry["quant_algo"]).upper(), "where": f"{field_name}.quant_algo"}


def _fp8_method(config: Mapping[str, Any]) -> QuantSpec:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{CONFIG_JSON}.fmt = {fmt!r} is not supported; tokenmill reads FP8 E4M3 weights")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{CONFIG_JSON}.activation_scheme = {scheme!r} is not supported; use dynamic or static")
    exclude = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    common = {"static_input_scale": scheme == "static"}
    block = config.get("weight_block_size")
    if block is None:
        return QuantSpec({"quant_algo": "FP8", **common, "where": f"{CONFIG_JSON}.quant_method"}, exclude)
    return QuantSpec({"quant_algo": "FP8_BLOCK", "weight_block_size": list(block), "scale_name": "weight_scale_inv",
                      **common, "where": f"{CONFIG_JSON}.weight_block_size"}, exclude)


_CT_STRATEGIES = {"tensor": "FP8", "channel": "FP8_PER_CHANNEL_PER_TOKEN", "block": "FP8_BLOCK"}


def _compressed_tensors(config: Mapping[str, Any]) -> QuantSpec:
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"{CONFIG_JSON}.format = {fmt!r} is not supported; tokenmill reads compressed-tensors "
                          "float-quantized (FP8) checkpoints (NVFP4: a ModelOpt export, whose weight_scale_2 multiplies)")
    groups = config.get("config_groups") or {}
    schemes = {_ct_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ConfigError(f"{CONFIG_JSON}.config_groups must hold one FP8 weight scheme, found {len(schemes)}")
    algo, block, static = schemes.pop()
    settings: dict[str, Any] = {"quant_algo": algo, "static_input_scale": static, "scale_name": "weight_scale",
                                "where": f"{CONFIG_JSON}.config_groups"}
    if block is not None:
        settings["weight_block_size"] = list(block)
    return QuantSpec(settings, tuple(config.get("ignore") or ()))


def _ct_scheme(name: str, group: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None, bool]:
    where = f"{CONFIG_JSON}.config_groups.{name}"
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ConfigError(f"{where}.weights = {dict(weights)!r} is not supported; tokenmill reads 8-bit float weights")
    strategy = weights.get("strategy")
    if strategy not in _CT_STRATEGIES:
        raise ConfigError(f"{where}.weights.strategy = {strategy!r} is not supported; use tensor, channel or block")
    activations = group.get("input_activations") or {}
    static = bool(activations) and not activations.get("dynamic", True)
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    return _CT_STRATEGIES[strategy], block, static

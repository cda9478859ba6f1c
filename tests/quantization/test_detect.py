"""Detection of a checkpoint's quantization from config.json / hf_quant_config.json, in the
layouts the published checkpoints use, and the start-up refusals for what tokenmill cannot read."""

from __future__ import annotations

import pytest

from tokenmill.errors import ConfigError
from tokenmill.quantization.checkpoint import CheckpointQuantization, excluded
from tokenmill.quantization.detect import read_quant_spec
from tokenmill.quantization.format_base import EngineChoices
from tokenmill.quantization.nvfp4 import Nvfp4LinearMethod
from tokenmill.quantization.nvfp4_experts import Nvfp4FusedMoEMethod
from tokenmill.quantization.scaled_fp8 import ScaledFp8LinearMethod
from tokenmill.quantization.scaled_fp8_experts import ScaledFp8FusedMoEMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod

# config.json quantization_config of DeepSeek-V3 / Qwen3-*-FP8 (block FP8, dynamic activations)
DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QWEN3_FP8 = {**DEEPSEEK_V3, "modules_to_not_convert": ["lm_head"]}
# hf_quant_config.json of a ModelOpt FP8 export, and the newer config.json form of the same
MODELOPT_FP8_FILE = {"producer": {"name": "modelopt", "version": "0.19.0"},
                     "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
MODELOPT_FP8_CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "model.layers.*.mlp.gate"],
                       "producer": {"name": "modelopt", "version": "0.37.0"},
                       "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
MODELOPT_MXFP8_FILE = {"producer": {"name": "modelopt", "version": "0.39.0"},
                       "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
# compressed-tensors FP8-dynamic (per-channel weights, per-token activations), as llm-compressor writes it
CT_FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}


def mixed(layers: dict[str, dict]) -> dict:
    return {"producer": {"name": "modelopt", "version": "0.39.0"},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"],
                             "quantized_layers": layers}}


LLAMA_NAMES = {
    "model.layers.0.self_attn.qkv_proj": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                          "model.layers.0.self_attn.v_proj"],
    "model.layers.0.mlp.experts": [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2)
                                   for p in ("gate_proj", "up_proj", "down_proj")],
    "model.layers.0.mlp.gate": ["model.layers.0.mlp.gate"],
    "lm_head": ["lm_head"],
}


def quant(config: dict | None, file: dict | None) -> CheckpointQuantization:
    spec = read_quant_spec(config, file)
    assert spec is not None
    return CheckpointQuantization(spec, checkpoint_names=lambda prefix: LLAMA_NAMES.get(prefix, [prefix]))


@pytest.mark.parametrize(
    "config,file,algo,scale",
    [
        (DEEPSEEK_V3, None, "FP8_BLOCK", "weight_scale_inv"),
        (QWEN3_FP8, None, "FP8_BLOCK", "weight_scale_inv"),
        (None, MODELOPT_FP8_FILE, "FP8", "weight_scale"),
        (MODELOPT_FP8_CONFIG, MODELOPT_FP8_FILE, "FP8", "weight_scale"),
        (None, MODELOPT_MXFP8_FILE, "MXFP8", "weight_scale"),
        (CT_FP8_DYNAMIC, None, "FP8", "weight_scale"),
    ],
    ids=["deepseek-v3", "qwen3-fp8", "modelopt-fp8-file", "modelopt-fp8-both", "modelopt-mxfp8", "ct-fp8-dynamic"],
)
def test_each_convention_quantizes_the_body(config, file, algo, scale) -> None:
    q = quant(config, file)
    assert q.name == algo
    method = q.linear_method("model.layers.0.self_attn.qkv_proj")
    assert isinstance(method, ScaledFp8LinearMethod) and method.layout.scale_name == scale
    assert isinstance(q.experts_method("model.layers.0.mlp.experts"), ScaledFp8FusedMoEMethod)


def test_exclusions_keep_layers_unquantized() -> None:
    assert isinstance(quant(QWEN3_FP8, None).linear_method("lm_head"), UnquantizedLinearMethod)
    assert isinstance(quant(DEEPSEEK_V3, None).linear_method("lm_head"), ScaledFp8LinearMethod)
    assert isinstance(quant(MODELOPT_FP8_CONFIG, None).linear_method("model.layers.0.mlp.gate"), UnquantizedLinearMethod)
    assert isinstance(quant(CT_FP8_DYNAMIC, None).linear_method("model.layers.0.mlp.gate"), UnquantizedLinearMethod)
    assert excluded("model.layers.3.mlp.gate", ["mlp.gate"]) and not excluded("model.layers.3.mlp.gate_proj", ["mlp.gate"])
    assert excluded("mtp.layers.0.eh_proj", ["mtp*"]) and excluded("model.layers.0.mlp", ["model.layers.0"])


def test_static_input_scales_are_read_where_the_convention_has_them() -> None:
    assert quant(None, MODELOPT_FP8_FILE).linear_method("o_proj").layout.input_scale
    assert not quant(CT_FP8_DYNAMIC, None).linear_method("o_proj").layout.input_scale
    assert not quant(DEEPSEEK_V3, None).linear_method("o_proj").layout.input_scale
    assert quant({**DEEPSEEK_V3, "activation_scheme": "static"}, None).linear_method("o_proj").layout.input_scale


def test_mixed_precision_maps_mxfp8_experts_beside_a_bf16_body() -> None:
    experts = {f"model.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "MXFP8"} for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}
    q = quant(None, mixed(experts))
    method = q.experts_method("model.layers.0.mlp.experts")
    assert isinstance(method, ScaledFp8FusedMoEMethod) and method.layout.scale_dtype.itemsize == 1
    assert isinstance(q.linear_method("model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert isinstance(q.experts_method("model.layers.1.mlp.experts"), UnquantizedFusedMoEMethod)
    partial = dict(experts)
    del partial["model.layers.0.mlp.experts.1.down_proj"]
    with pytest.raises(ConfigError, match="model.layers.0.mlp.experts fuses checkpoint layers stored in different formats"):
        quant(None, mixed(partial)).experts_method("model.layers.0.mlp.experts")


# hf_quant_config.json of a ModelOpt NVFP4 export, and the config.json form of the same
MODELOPT_NVFP4_FILE = {"producer": {"name": "modelopt", "version": "0.39.0"},
                       "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": ["lm_head"]}}
MODELOPT_NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"],
                         "producer": {"name": "modelopt", "version": "0.39.0"}}


@pytest.mark.parametrize("config,file,algo,activations", [
    (None, MODELOPT_NVFP4_FILE, "NVFP4", "w4a16"),
    (MODELOPT_NVFP4_CONFIG, None, "NVFP4", "w4a16"),
    (MODELOPT_NVFP4_CONFIG, MODELOPT_NVFP4_FILE, "NVFP4", "w4a16"),
    (None, {"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}},
     "W4A16_NVFP4", "w4a16"),
], ids=["file", "config", "both", "w4a16-nvfp4"])
def test_nvfp4_checkpoints_quantize_the_body_and_experts(config, file, algo, activations) -> None:
    q = quant(config, file)
    assert q.name == algo
    method = q.linear_method("model.layers.0.self_attn.qkv_proj")
    assert isinstance(method, Nvfp4LinearMethod) and method.activations == activations
    assert method.input_scales == (algo == "NVFP4")
    assert isinstance(q.experts_method("model.layers.0.mlp.experts"), Nvfp4FusedMoEMethod)
    assert isinstance(q.linear_method("lm_head"), UnquantizedLinearMethod)


def test_mixed_precision_maps_nvfp4_beside_fp8_mxfp8_and_bf16_layers() -> None:
    attention = {f"model.layers.0.self_attn.{p}_proj": {"quant_algo": "NVFP4", "group_size": 16} for p in "qkv"}
    experts = {f"model.layers.0.mlp.experts.{e}.{p}": {"quant_algo": "MXFP8"} for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}
    layers = {**attention, **experts, "model.layers.0.self_attn.o_proj": {"quant_algo": "FP8"}}
    q = quant(None, mixed(layers))
    assert q.name == "FP8+MXFP8+NVFP4"
    assert isinstance(q.linear_method("model.layers.0.self_attn.qkv_proj"), Nvfp4LinearMethod)
    assert isinstance(q.linear_method("model.layers.0.self_attn.o_proj"), ScaledFp8LinearMethod)
    assert isinstance(q.experts_method("model.layers.0.mlp.experts"), ScaledFp8FusedMoEMethod)
    assert isinstance(q.linear_method("model.layers.1.mlp.down_proj"), UnquantizedLinearMethod)
    del attention["model.layers.0.self_attn.v_proj"]
    with pytest.raises(ConfigError, match=r"qkv_proj fuses checkpoint layers stored in different formats .*v_proj: "
                                          "unquantized"):
        quant(None, mixed({**attention, **experts})).linear_method("model.layers.0.self_attn.qkv_proj")


def test_the_nvfp4_mode_reaches_the_format() -> None:
    spec = read_quant_spec(None, MODELOPT_NVFP4_FILE)
    assert CheckpointQuantization(spec, choices=EngineChoices((10, 0))).linear_method("o_proj").activations == "w4a16"
    blackwell = CheckpointQuantization(spec, choices=EngineChoices((10, 0), "w4a4"))
    assert blackwell.linear_method("o_proj").activations == "w4a4"
    with pytest.raises(ConfigError, match="--nvfp4-mode w4a4 needs FP4 tensor cores"):
        CheckpointQuantization(spec, choices=EngineChoices((9, 0), "w4a4"))


@pytest.mark.parametrize(
    "config,file,message",
    [
        ({"quant_method": "awq", "bits": 4}, None, r"config.json quantization_config.quant_method = 'awq' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, None, "format = 'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, None,
         "format = 'nvfp4-pack-quantized' is not supported.*NVFP4: a ModelOpt export"),
        ({**CT_FP8_DYNAMIC, "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}, None,
         r"group_0.weights = .* tokenmill reads 8-bit float weights"),
        ({**DEEPSEEK_V3, "weight_block_size": [64, 64]}, None, r"weight_block_size = \[64, 64\] is not supported"),
        ({**DEEPSEEK_V3, "fmt": "e5m2"}, None, "fmt = 'e5m2'"),
        (None, {"quantization": {"quant_algo": "W8A8_SQ_PER_CHANNEL"}}, "does not read W8A8_SQ_PER_CHANNEL layers"),
        (None, {"quantization": {"quant_algo": "MIXED_PRECISION"}}, "needs a non-empty quantized_layers map"),
        (MODELOPT_FP8_CONFIG, MODELOPT_MXFP8_FILE, "config.json quantization_config says FP8 but hf_quant_config.json"),
        (None, {"producer": {}}, "hf_quant_config.json has no \"quantization\" section"),
    ],
)
def test_refusals_name_the_field_and_its_value(config, file, message) -> None:
    with pytest.raises(ConfigError, match=message):
        quant(config, file)


def test_no_config_is_an_unquantized_checkpoint() -> None:
    assert read_quant_spec(None, None) is None

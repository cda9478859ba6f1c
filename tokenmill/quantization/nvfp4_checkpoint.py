"""NVFP4 checkpoints (NVIDIA Model Optimizer's quant_algo "NVFP4", and "W4A16_NVFP4" without
input scales): E2M1 weights two per byte, one E4M3 scale per 16 input columns, one float32
global scale per tensor.

On disk, per linear layer X: `X.weight` uint8 [N, K / 2] (element 2i in the low nibble),
`X.weight_scale` float8_e4m3fn [N, K / 16], `X.weight_scale_2` float32 (one value, a multiplier:
ModelOpt's convention; compressed-tensors' nvfp4-pack-quantized divides, and is not read), and
for NVFP4 `X.input_scale` float32 (one value). Stacked experts load the same per expert.

Activations (`--nvfp4-mode`): W4A16 keeps them in the model dtype and decodes the weight in the
kernels (Hopper has no FP4 MMA: the default there, the checkpoint's input scales then unused);
W4A4 quantizes them per 16 under input_scale (Blackwell's FP4 MMAs: sm_100, sm_120, sm_121, the
default there for a checkpoint with input scales; refused elsewhere). Routed experts run W4A16
on every device. `tokenmill quantize --format nvfp4` writes NVFP4 with input scales from
calibration and one global scale per fused group (q/k/v, gate/up, an expert's gate and up), as
ModelOpt exports them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.errors import ConfigError
from tokenmill.numerics import (
    FP8_E4M3,
    NVFP4_GROUP,
    e2m1_decode,
    e2m1_encode,
    nvfp4_block_scale,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from tokenmill.quantization.base import FusedMoEMethod, LinearMethod
from tokenmill.quantization.encoding import (
    Calibration,
    CheckpointConfigFiles,
    CheckpointEncoder,
    GroupRounding,
    modelopt_config_files,
)
from tokenmill.quantization.format_base import CheckpointFormat, EngineChoices, FormatSettings, setting
from tokenmill.quantization.nvfp4 import W4A4, W4A16, Nvfp4LinearMethod
from tokenmill.quantization.nvfp4_experts import Nvfp4FusedMoEMethod

logger = logging.getLogger(__name__)
_told: set[str] = set()  # the configs whose unused input scales were logged


def activations_mode(settings: FormatSettings, choices: EngineChoices) -> str:
    """W4A4 or W4A16 for an NVFP4 format (the module docstring); refuses what the device cannot run."""
    has_inputs = settings["quant_algo"] == "NVFP4"
    capability = choices.capability
    blackwell = capability is not None and capability[0] >= 10
    where = settings.get("where", "the quantization config")
    if choices.nvfp4_mode == W4A4:
        if not has_inputs:
            raise ConfigError(f"--nvfp4-mode w4a4 quantizes activations under the checkpoint's input scales, but "
                              f"{where} is {settings['quant_algo']} (no input_scale); use --nvfp4-mode auto or w4a16")
        if not blackwell:
            device = f"sm_{capability[0]}{capability[1]}" if capability else "not a GPU"
            raise ConfigError(f"--nvfp4-mode w4a4 needs FP4 tensor cores (Blackwell: sm_100, sm_120, sm_121) and this "
                              f"device is {device}; use --nvfp4-mode w4a16 (or auto), which multiplies the NVFP4 "
                              "weights with activations in the model dtype")
        if where not in _told:
            _told.add(where)
            logger.warning("%s: W4A4 quantizes the activations per 16 under the input scales, then multiplies the "
                           "decoded values on bf16 tensor cores (no FP4 MMA kernel yet): W4A4's numerics at W4A16's "
                           "speed or below", where)
        return W4A4
    if has_inputs and where not in _told:
        _told.add(where)
        logger.info("%s: NVFP4 weights with activations in the model dtype (W4A16); the checkpoint's input scales "
                    "are loaded but unused", where)
    return W4A16


class Nvfp4Config(CheckpointFormat):
    quant_algo = "NVFP4"

    def __init__(self, activations: str, input_scales: bool, use_triton: bool = False) -> None:
        self.activations = activations
        self.input_scales = input_scales
        self.use_triton = use_triton
        self.name = f"{self.quant_algo} ({activations})"

    @classmethod
    def from_settings(cls, settings: FormatSettings, use_triton: bool,
                      choices: EngineChoices = EngineChoices()) -> Nvfp4Config:
        setting(settings, "group_size", NVFP4_GROUP)
        return cls(activations_mode(settings, choices), settings["quant_algo"] == "NVFP4", use_triton)

    def linear_method(self, prefix: str) -> LinearMethod:
        return Nvfp4LinearMethod(prefix, self.activations, self.input_scales, self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        return Nvfp4FusedMoEMethod(prefix, self.input_scales, self.use_triton)


class W4A16Nvfp4Config(Nvfp4Config):
    quant_algo = "W4A16_NVFP4"


BLOCK_SCALE = "weight_block_scale"
"""Calibration entry: E4M3 scales [N, K / 16] fixed by GPTQ, used instead of the weight's own."""


class Nvfp4Rounding(GroupRounding):
    """NVFP4 for GPTQ: a group's E4M3 scale from its values when the walk reaches it (the encoder's
    rule), each column rounded to E2M1 under it and decoded as readers decode it."""

    group = NVFP4_GROUP

    def __init__(self, rows: int, columns: int, global_scale: torch.Tensor) -> None:
        self.global_scale = global_scale
        self.scales = torch.empty(rows, columns // NVFP4_GROUP, dtype=FP8_E4M3)

    def start_group(self, index: int, values: torch.Tensor) -> None:
        self.scales[:, index] = nvfp4_block_scale(values.abs().amax(dim=-1), self.global_scale).cpu()

    def round(self, index: int, column: torch.Tensor) -> torch.Tensor:
        scale = self.scales[:, index].to(column.device).float()
        return e2m1_decode(e2m1_encode(column / (scale * self.global_scale))) * scale * self.global_scale

    def fixed(self) -> dict[str, torch.Tensor]:
        return {BLOCK_SCALE: self.scales}


def weight_global_scale(weight: torch.Tensor, calibration: Calibration) -> torch.Tensor:
    """weight_scale_2: over the fused group's weight_amax where calibration gives one, else the weight's own."""
    return nvfp4_global_scale(calibration.get("weight_amax", weight.abs().amax()))


class Nvfp4Encoder(CheckpointEncoder):
    """ModelOpt NVFP4: weight_scale_2 = amax / (6 * 448) over the layer (or its fused group: the
    calibration's weight_amax), E4M3 scales per 16, static input scale input_amax / (6 * 448)."""

    name = "nvfp4"
    quant_algo = "NVFP4"
    column_group = NVFP4_GROUP

    def encode(self, name: str, weight: torch.Tensor, calibration: Calibration) -> dict[str, torch.Tensor]:
        global_scale = weight_global_scale(weight, calibration)
        packed, scale = quantize_nvfp4(weight, global_scale, calibration.get(BLOCK_SCALE))
        return {"weight": packed, "weight_scale": scale, "weight_scale_2": global_scale,
                "input_scale": nvfp4_global_scale(calibration["input_amax"])}

    def group_rounding(self, weight: torch.Tensor, calibration: Calibration) -> Nvfp4Rounding:
        return Nvfp4Rounding(weight.shape[0], weight.shape[1], weight_global_scale(weight, calibration))

    def layer_entry(self) -> dict[str, Any]:
        return {"quant_algo": self.quant_algo, "group_size": NVFP4_GROUP}

    def config_files(self, exclude: Sequence[str]) -> CheckpointConfigFiles:
        return modelopt_config_files({"quant_algo": self.quant_algo, "group_size": NVFP4_GROUP,
                                      "kv_cache_quant_algo": None, "exclude_modules": list(exclude)})

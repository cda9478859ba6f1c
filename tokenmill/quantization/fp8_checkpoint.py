"""FP8 E4M3 checkpoints with one scale per tensor or per output row: ModelOpt's FP8 and
FP8_PER_CHANNEL_PER_TOKEN, compressed-tensors' float-quantized tensor and channel strategies,
and quant_method "fp8" without blocks.

On disk, per linear layer X: `X.weight` float8_e4m3fn [N, K], `X.weight_scale` float32 (one
value, or [N] / [N, 1]), and with static activations `X.input_scale` float32 (one value). The
real weight is weight * weight_scale. `tokenmill quantize --format fp8` writes ModelOpt's FP8:
per-tensor weight scales amax / 448 and input scales from the calibrated activation amax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.numerics import FP8_E4M3_MAX, quantize_e4m3
from tokenmill.quantization.base import FusedMoEMethod, LinearMethod
from tokenmill.quantization.encoding import Calibration, CheckpointConfigFiles, CheckpointEncoder, modelopt_config_files
from tokenmill.quantization.format_base import CheckpointFormat, EngineChoices, FormatSettings
from tokenmill.quantization.scaled_fp8 import ScaledFp8LinearMethod, ScaleLayout
from tokenmill.quantization.scaled_fp8_experts import ScaledFp8FusedMoEMethod


class ScaledFp8Format(CheckpointFormat):
    """A format whose layers are FP8 E4M3 weights with the scales of `layout`."""

    def __init__(self, layout: ScaleLayout, use_triton: bool = False) -> None:
        self.layout = layout
        self.use_triton = use_triton
        self.name = f"{self.quant_algo} ({layout.scale_name} per {layout.block})"

    def linear_method(self, prefix: str) -> LinearMethod:
        return ScaledFp8LinearMethod(self.layout, prefix, self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        return ScaledFp8FusedMoEMethod(self.layout, prefix, self.use_triton)


class Fp8Config(ScaledFp8Format):
    """Per-tensor or per-channel scales (the loader takes either shape): W8A8 with activations
    quantized per token for prefill."""

    quant_algo = "FP8"

    @classmethod
    def from_settings(cls, settings: FormatSettings, use_triton: bool,
                      choices: EngineChoices = EngineChoices()) -> Fp8Config:
        static = bool(settings.get("static_input_scale", settings.get("quant_algo") == "FP8"))
        return cls(ScaleLayout("weight_scale", (1, 0), torch.float32, "w8a8-rows", input_scale=static), use_triton)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps amax to E4M3's largest value (1.0 for all-zero values)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


class Fp8Encoder(CheckpointEncoder):
    """ModelOpt FP8: per-tensor weight scale, static per-tensor input scale."""

    name = "fp8"
    quant_algo = "FP8"

    def encode(self, name: str, weight: torch.Tensor, calibration: Calibration) -> dict[str, torch.Tensor]:
        weight_scale = scale_of(weight.abs().amax())
        return {"weight": quantize_e4m3(weight, weight_scale), "weight_scale": weight_scale,
                "input_scale": scale_of(calibration["input_amax"])}

    def layer_entry(self) -> dict[str, Any]:
        return {"quant_algo": self.quant_algo}

    def config_files(self, exclude: Sequence[str]) -> CheckpointConfigFiles:
        return modelopt_config_files({"quant_algo": self.quant_algo, "kv_cache_quant_algo": None,
                                      "exclude_modules": list(exclude)})

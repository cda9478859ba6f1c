"""MXFP8 checkpoints (ModelOpt quant_algo "MXFP8"): FP8 E4M3 weights with one E8M0 scale per 32
input columns.

On disk, per linear layer X: `X.weight` float8_e4m3fn [N, K] and `X.weight_scale` uint8
[N, K / 32], each the biased exponent of a power-of-two scale 2^(code - 127) chosen as
2^ceil(log2(amax / 448)) over its 32 weights. Hopper has no MX tensor-core instruction, so the
kernels dequantize in registers (exactly: an E4M3 value times a power of two is a bf16 value)
and multiply in bf16 (W8A16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.numerics import MX_GROUP, e8m0_exponent, e8m0_to_float, quantize_e4m3
from tokenmill.quantization.encoding import Calibration, CheckpointConfigFiles, CheckpointEncoder, modelopt_config_files
from tokenmill.quantization.format_base import EngineChoices, FormatSettings
from tokenmill.quantization.fp8_block import block_amax
from tokenmill.quantization.fp8_checkpoint import ScaledFp8Format
from tokenmill.quantization.scaled_fp8 import ScaleLayout


class MxFp8Config(ScaledFp8Format):
    quant_algo = "MXFP8"

    @classmethod
    def from_settings(cls, settings: FormatSettings, use_triton: bool,
                      choices: EngineChoices = EngineChoices()) -> MxFp8Config:
        return cls(ScaleLayout("weight_scale", (1, MX_GROUP), torch.uint8, "w8a16"), use_triton)


class MxFp8Encoder(CheckpointEncoder):
    name = "mxfp8"
    quant_algo = "MXFP8"
    column_group = MX_GROUP

    def encode(self, name: str, weight: torch.Tensor, calibration: Calibration) -> dict[str, torch.Tensor]:
        codes = e8m0_exponent(block_amax(weight.float(), (1, MX_GROUP)))
        factors = e8m0_to_float(codes).repeat_interleave(MX_GROUP, 1)[:, : weight.shape[1]]
        return {"weight": quantize_e4m3(weight, factors), "weight_scale": codes}

    def layer_entry(self) -> dict[str, Any]:
        return {"quant_algo": self.quant_algo}

    def config_files(self, exclude: Sequence[str]) -> CheckpointConfigFiles:
        return modelopt_config_files({"quant_algo": self.quant_algo, "kv_cache_quant_algo": None,
                                      "exclude_modules": list(exclude)})

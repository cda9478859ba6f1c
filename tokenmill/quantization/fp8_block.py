"""FP8 E4M3 checkpoints with one scale per 128 x 128 block: DeepSeek-V3 / Qwen3-FP8's
quant_method "fp8" with weight_block_size [128, 128] (`X.weight_scale_inv`, despite the name a
multiplier), compressed-tensors' block strategy and ModelOpt's FP8_PB_WO (`X.weight_scale`).

On disk, per linear layer X: `X.weight` float8_e4m3fn [N, K] and the scales float32
[ceil(N / 128), ceil(K / 128)] (ModelOpt: [N / 128, 1, K / 128, 1]). The real weight is each
block times its scale. Prefill quantizes activations per token per 128 columns (W8A8).
`tokenmill quantize --format fp8-block` writes the DeepSeek convention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.numerics import ScaleBlock, quantize_e4m3
from tokenmill.quantization.encoding import Calibration, CheckpointConfigFiles, CheckpointEncoder
from tokenmill.quantization.format_base import EngineChoices, FormatSettings, setting
from tokenmill.quantization.fp8_checkpoint import ScaledFp8Format, scale_of
from tokenmill.quantization.scaled_fp8 import ScaleLayout

BLOCK = 128


class Fp8BlockConfig(ScaledFp8Format):
    quant_algo = "FP8_BLOCK"

    @classmethod
    def from_settings(cls, settings: FormatSettings, use_triton: bool,
                      choices: EngineChoices = EngineChoices()) -> Fp8BlockConfig:
        setting(settings, "weight_block_size", [BLOCK, BLOCK])
        layout = ScaleLayout(settings.get("scale_name", "weight_scale_inv"), (BLOCK, BLOCK), torch.float32,
                             "w8a8-blocks", input_scale=bool(settings.get("static_input_scale", False)))
        return cls(layout, use_triton)


def block_amax(weight: torch.Tensor, block: ScaleBlock) -> torch.Tensor:
    """The largest |w| of each (rows x cols) block of weight [N, K] (ragged edge blocks included)."""
    rows, cols = block
    n, k = weight.shape
    padded = F.pad(weight.abs(), (0, -k % cols, 0, -n % rows))
    return padded.unflatten(0, (-1, rows)).unflatten(2, (-1, cols)).amax(dim=(1, 3))


class Fp8BlockEncoder(CheckpointEncoder):
    name = "fp8-block"
    quant_algo = "FP8_BLOCK"

    def encode(self, name: str, weight: torch.Tensor, calibration: Calibration) -> dict[str, torch.Tensor]:
        scale = scale_of(block_amax(weight.float(), (BLOCK, BLOCK)))
        factors = scale.repeat_interleave(BLOCK, 0)[: weight.shape[0]].repeat_interleave(BLOCK, 1)[:, : weight.shape[1]]
        return {"weight": quantize_e4m3(weight, factors), "weight_scale_inv": scale}

    def layer_entry(self) -> dict[str, Any]:
        return {"quant_algo": self.quant_algo, "weight_block_size": [BLOCK, BLOCK]}

    def config_files(self, exclude: Sequence[str]) -> CheckpointConfigFiles:
        return CheckpointConfigFiles(
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": list(exclude)},
            hf_quant_config=None,
        )

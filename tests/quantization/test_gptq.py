"""GPTQ's rounding (quantize/gptq.py) with NVFP4's GroupRounding: on inputs with no correlation
it is round-to-nearest exactly; on correlated inputs it moves the layer's outputs much less than
round-to-nearest does; and the encoder writes the rounded weight bit for bit under the scales used."""

from __future__ import annotations

import torch

from tokenmill.numerics import dequantize_nvfp4, quantize_nvfp4
from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Encoder
from tokenmill.quantize.gptq import HessianSum, gptq_round

ROWS, COLUMNS, TOKENS = 48, 160, 1024  # 160 columns: a last block shorter than gptq.BLOCK


def nearest(weight: torch.Tensor, calibration: dict[str, torch.Tensor]) -> torch.Tensor:
    encoded = Nvfp4Encoder().encode("layer", weight, calibration)
    return dequantize_nvfp4(encoded["weight"], encoded["weight_scale"], encoded["weight_scale_2"])


def rounded_by_gptq(weight: torch.Tensor, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hessians = HessianSum()
    for part in inputs.split(300):  # summed over several calls, as calibration's forwards do
        hessians.note("layer", part)
    calibration = {"input_amax": inputs.abs().amax()}
    rounding = Nvfp4Encoder().group_rounding(weight, calibration)
    return gptq_round(weight, hessians.sums["layer"], rounding), {**calibration, **rounding.fixed()}


def test_uncorrelated_inputs_round_to_nearest() -> None:
    weight = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0))
    hessians = HessianSum()
    hessians.note("layer", torch.eye(COLUMNS))  # H = I: no column's error has anywhere to go
    rounding = Nvfp4Encoder().group_rounding(weight, {"input_amax": torch.tensor(1.0)})
    rounded = gptq_round(weight, hessians.sums["layer"], rounding)
    assert torch.equal(rounded, nearest(weight, {"input_amax": torch.tensor(1.0)}))
    _, scale = quantize_nvfp4(weight, Nvfp4Encoder().encode("layer", weight, {"input_amax": torch.tensor(1.0)})
                              ["weight_scale_2"])
    assert torch.equal(rounding.fixed()["weight_block_scale"].view(torch.uint8), scale.view(torch.uint8))


def test_correlated_inputs_move_the_outputs_less_than_nearest() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(ROWS, COLUMNS, generator=generator)
    mixing = torch.randn(COLUMNS, COLUMNS, generator=generator) / COLUMNS**0.5
    inputs = torch.randn(TOKENS, COLUMNS, generator=generator) @ mixing + 0.3 * torch.randn(TOKENS, COLUMNS,
                                                                                            generator=generator)
    rounded, calibration = rounded_by_gptq(weight, inputs)
    reference = inputs @ weight.T
    gptq_error = (inputs @ rounded.T - reference).norm()
    nearest_error = (inputs @ nearest(weight, calibration).T - reference).norm()
    assert gptq_error < 0.85 * nearest_error, (gptq_error, nearest_error)  # 0.78 here; no feedback: 1.0


def test_the_encoder_writes_the_rounded_weight_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(ROWS, COLUMNS, generator=generator) * torch.linspace(0.1, 3.0, COLUMNS)
    inputs = torch.randn(TOKENS, COLUMNS, generator=generator).cumsum(dim=1) / 8  # strongly correlated neighbours
    rounded, calibration = rounded_by_gptq(weight, inputs)
    encoded = Nvfp4Encoder().encode("layer", rounded, calibration)
    assert torch.equal(encoded["weight_scale"].view(torch.uint8), calibration["weight_block_scale"].view(torch.uint8))
    assert torch.equal(dequantize_nvfp4(encoded["weight"], encoded["weight_scale"], encoded["weight_scale_2"]), rounded)
    assert not torch.equal(rounded, nearest(weight, calibration))  # the error feedback changed some roundings

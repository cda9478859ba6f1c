"""NVFP4 weights made at load from a high-precision checkpoint (a drafter's `quantization:
nvfp4`): each linear layer is created like an unquantized one, then encoded as ModelOpt's
NVFP4 (E2M1 values, E4M3 scales per 16 columns, one float32 global scale per shard, no
calibration) and run weight-only (W4A16: the NVFP4 kernels decode the weight, activations stay
in the model dtype; Hopper has no FP4 MMA), as dual weights' NVFP4 copy of a high-precision
checkpoint is (quantization/dual.py). MoE experts are refused: a drafter is dense.
"""

from __future__ import annotations

import torch

from tokenmill.errors import ConfigError
from tokenmill.quantization.base import FusedMoEMethod, LinearLayer, LinearMethod
from tokenmill.quantization.checkpoint import ROUTERS, excluded
from tokenmill.quantization.dual import NVFP4_COPY, DualLinearMethod
from tokenmill.quantization.nvfp4 import check_group_columns
from tokenmill.quantization.unquantized import Unquantized, UnquantizedLinearMethod


class Nvfp4OnLoadLinearMethod(LinearMethod):
    def __init__(self, prefix: str, use_triton: bool = False) -> None:
        self.prefix = prefix
        self.use_triton = use_triton
        self.plain = UnquantizedLinearMethod(use_triton)
        self.nvfp4 = NVFP4_COPY.linear(prefix, use_triton)
        self.quantized = False
        self.name = "nvfp4 w4a16 (quantized at load)"

    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        check_group_columns(self.prefix, layer.in_features)
        self.plain.create_weights(layer, dtype, device)

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        if self.quantized:
            return
        weight = layer.weight.detach().float()
        del layer.weight  # type: ignore[attr-defined]
        self.nvfp4.create_weights(layer, weight.dtype, weight.device)
        DualLinearMethod._encode_into(layer, self.nvfp4, NVFP4_COPY.encode, weight)  # type: ignore[arg-type]
        self.quantized = True

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        return (self.nvfp4 if self.quantized else self.plain).apply(layer, x)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return (self.nvfp4 if self.quantized else self.plain).dequantized_weight(layer)


class Nvfp4OnLoad(Unquantized):
    """Every linear layer (an output head too; MoE routers aside) quantized to NVFP4 W4A16 at load."""

    name = "nvfp4 (w4a16, quantized at load)"

    def linear_method(self, prefix: str) -> LinearMethod:
        if excluded(prefix, ROUTERS):
            return UnquantizedLinearMethod(self.use_triton)
        return Nvfp4OnLoadLinearMethod(prefix, self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        raise ConfigError(f"{prefix}: quantization nvfp4 at load is for dense drafters; MoE experts are not quantized "
                          "this way (use an NVFP4 checkpoint)")

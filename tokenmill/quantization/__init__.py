"""Quantization methods: how linear layers and MoE experts store and multiply their weights, and FP8 KV-cache scales."""

from tokenmill.quantization.base import FusedMoEMethod, LinearMethod, QuantizationConfig
from tokenmill.quantization.fp8 import Fp8OnLoad, Fp8RowLinearMethod, fp8_rows, quantize_fp8_
from tokenmill.quantization.unquantized import Unquantized, UnquantizedLinearMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod

__all__ = ["Fp8OnLoad", "Fp8RowLinearMethod", "FusedMoEMethod", "LinearMethod", "QuantizationConfig", "Unquantized",
           "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "fp8_rows", "quantize_fp8_"]

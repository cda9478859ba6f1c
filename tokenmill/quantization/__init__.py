"""Quantization methods: how linear layers store and multiply their weights, and FP8 KV-cache scales."""

from tokenmill.quantization.base import LinearMethod, QuantizationConfig
from tokenmill.quantization.fp8 import Fp8OnLoad, Fp8RowLinearMethod, fp8_rows, quantize_fp8_
from tokenmill.quantization.unquantized import Unquantized, UnquantizedLinearMethod

__all__ = ["Fp8OnLoad", "Fp8RowLinearMethod", "LinearMethod", "QuantizationConfig", "Unquantized",
           "UnquantizedLinearMethod", "fp8_rows", "quantize_fp8_"]

"""The quantized formats tokenmill reads and writes, by name: one line per format in each table.

FORMATS: a checkpoint's quant_algo (as quantization/detect.py normalises it from ModelOpt,
compressed-tensors or DeepSeek-style configs) -> its CheckpointFormat (reading).
ENCODERS: a `tokenmill quantize --format` value -> its CheckpointEncoder (writing).
"""

from __future__ import annotations

from tokenmill.quantization.encoding import CheckpointEncoder
from tokenmill.quantization.format_base import CheckpointFormat
from tokenmill.quantization.fp8_block import Fp8BlockConfig, Fp8BlockEncoder
from tokenmill.quantization.fp8_checkpoint import Fp8Config, Fp8Encoder
from tokenmill.quantization.mxfp8 import MxFp8Config, MxFp8Encoder
from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Config, Nvfp4Encoder, W4A16Nvfp4Config

FORMATS: dict[str, type[CheckpointFormat]] = {
    "FP8": Fp8Config,
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Config,
    "FP8_BLOCK": Fp8BlockConfig,
    "MXFP8": MxFp8Config,
    "NVFP4": Nvfp4Config,
    "W4A16_NVFP4": W4A16Nvfp4Config,
}

ENCODERS: dict[str, type[CheckpointEncoder]] = {
    "fp8": Fp8Encoder,
    "fp8-block": Fp8BlockEncoder,
    "mxfp8": MxFp8Encoder,
    "nvfp4": Nvfp4Encoder,
}

QUANTIZE_FORMATS = ("fp8", "fp8-block", "mxfp8", "nvfp4")
"""Every --format `tokenmill quantize` offers; one without an encoder above fails with a message."""

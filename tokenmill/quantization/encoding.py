"""The writing side of a checkpoint format: how `tokenmill quantize` turns one high-precision
weight into the tensors the format stores on disk, and the config entries that name the format.

An encoder sees one linear layer at a time, by its checkpoint module name (q_proj, not the
fused qkv_proj; experts.3.gate_proj, not the stacked experts), as float32 [N, K]. It returns
the layer's on-disk tensors by suffix, which the writer stores as f"{name}.{suffix}":
{"weight": ..., "weight_scale": ...}. Reading them back through the format's QuantizationConfig
(quantization/registry.py FORMATS[encoder.quant_algo]) must give the same dequantized weight bit
for bit (tests/quantization/test_round_trip.py holds every registered encoder to it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Calibration = Mapping[str, torch.Tensor]
"""What calibration measured for one layer, float32 0-d tensors by key:

    "input_amax"   the largest |x| entering the layer over the calibration text (always given;
                   a static activation scale derives from it, e.g. input_scale = amax / 448)
    "weight_amax"  given for layers whose per-tensor weight scale is shared with others: the
                   largest |w| over the group (the shards of a fused projection, q/k/v or gate/up,
                   and a MoE expert's gate and up, which ModelOpt's NVFP4 stores with one
                   weight_scale_2); absent: the weight's own amax

plus, after GPTQ, what the format's GroupRounding.fixed() gave (the scales the rounded weight
sits on, which the encoder then uses instead of deriving its own).
"""


class GroupRounding(ABC):
    """A format's rounding of one weight [N, K] group by group of `group` input columns, for
    GPTQ (quantize/gptq.py), which walks the columns in order."""

    group: int

    @abstractmethod
    def start_group(self, index: int, values: torch.Tensor) -> None:
        """Fix the scales of column group `index` from its current values [N, group]."""

    @abstractmethod
    def round(self, index: int, column: torch.Tensor) -> torch.Tensor:
        """Column [N] of group `index` rounded to the format: float32, as a reader decodes it."""

    @abstractmethod
    def fixed(self) -> dict[str, torch.Tensor]:
        """Calibration entries that make encode() write the rounded weight under the scales used."""


@dataclass(frozen=True)
class CheckpointConfigFiles:
    """A quantized checkpoint's config entries: config.json's `quantization_config` and the
    content of hf_quant_config.json (None where the format's convention has no such file)."""

    quantization_config: dict[str, Any]
    hf_quant_config: dict[str, Any] | None


class CheckpointEncoder(ABC):
    """One on-disk format of quantized linear weights (see the module docstring)."""

    name: str
    """The `tokenmill quantize --format` value, e.g. "fp8"."""
    quant_algo: str
    """The format's name in the checkpoint's config and the key of its reader in
    quantization/registry.py FORMATS, e.g. "FP8"."""
    column_group: int = 1
    """Input columns that share a scale and must divide K (MXFP8: 32, NVFP4: 16)."""

    @abstractmethod
    def encode(self, name: str, weight: torch.Tensor, calibration: Calibration) -> dict[str, torch.Tensor]:
        """The on-disk tensors of linear layer `name` (weight float32 [N, K]) by suffix."""

    @abstractmethod
    def layer_entry(self) -> dict[str, Any]:
        """This format's settings for one layer, as a MIXED_PRECISION `quantized_layers` entry
        (e.g. {"quant_algo": "NVFP4", "group_size": 16})."""

    def group_rounding(self, weight: torch.Tensor, calibration: Calibration) -> GroupRounding | None:
        """How GPTQ rounds this layer (weight float32 [N, K]) in this format; None where the format
        has no GPTQ rounding (the writer then refuses --gptq for it)."""
        return None

    @abstractmethod
    def config_files(self, exclude: Sequence[str]) -> CheckpointConfigFiles:
        """The config entries of a checkpoint quantized in this format with the modules matching
        `exclude` (fnmatch patterns of checkpoint module names) kept in high precision."""


def modelopt_config_files(quantization: dict[str, Any]) -> CheckpointConfigFiles:
    """The ModelOpt convention: hf_quant_config.json {"producer", "quantization": {...}} and the
    same settings in config.json with quant_method "modelopt"."""
    return CheckpointConfigFiles(
        quantization_config={"quant_method": "modelopt", **quantization},
        hf_quant_config={"producer": {"name": "tokenmill"}, "quantization": dict(quantization)},
    )

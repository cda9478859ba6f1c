"""What a checkpoint format is on the reading side: a QuantizationConfig built from its settings
in the checkpoint's config (`from_settings`), whose linear and experts methods create, load and
multiply the layers it quantizes. Which layers it quantizes is not its business: a checkpoint's
CheckpointQuantization (quantization/checkpoint.py) routes each layer to its format or leaves it
unquantized, from the exclusion lists and per-layer maps of the checkpoint's config.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.quantization.base import QuantizationConfig

FormatSettings = Mapping[str, Any]
"""One format's settings as the checkpoint states them, normalised by quantization/detect.py:
"quant_algo" (the FORMATS key) plus the format's own keys ("group_size", "weight_block_size",
...), and "where": the config file and field they were read from, for messages."""


NVFP4_MODES = ("auto", "w4a16", "w4a4")


@dataclass(frozen=True)
class EngineChoices:
    """What the engine brings to a checkpoint's formats beside the checkpoint's own settings."""

    capability: tuple[int, int] | None = None
    """The CUDA device's compute capability, e.g. (9, 0); None: no GPU (the reference paths)."""
    nvfp4_mode: str = "auto"
    """One of NVFP4_MODES (config.ModelConfig.nvfp4_mode)."""


class CheckpointFormat(QuantizationConfig):
    """A quantized checkpoint format (registered by its quant_algo in quantization/registry.py)."""

    quant_algo: str

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: FormatSettings, use_triton: bool,
                      choices: EngineChoices = EngineChoices()) -> CheckpointFormat:
        """The format for these settings; ConfigError (naming settings["where"] and the field) for
        settings it cannot honour."""


def setting(settings: FormatSettings, key: str, expected: object) -> None:
    """Refuse a setting whose value is not the one value this format reads."""
    value = settings.get(key, expected)
    if value != expected:
        raise ConfigError(f"{settings.get('where', 'the quantization config')}: {key} = {value!r} is not supported "
                          f"for {settings.get('quant_algo')}; tokenmill reads {key} = {expected!r}")

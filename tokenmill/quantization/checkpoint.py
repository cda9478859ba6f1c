"""A quantized checkpoint's QuantizationConfig: each layer to its format, or unquantized.

Layers are named twice: the model names its modules (model.layers.0.self_attn.qkv_proj,
...mlp.experts) and the checkpoint its own (q_proj, k_proj, v_proj; experts.3.gate_proj). The
config's exclusions and per-layer maps use the checkpoint's names, so `checkpoint_names` tells,
for a model module, the checkpoint modules that load into it (runner/model_builder.py derives it
from the checkpoint's tensor names and the model's packed mapping). A model module is in the
format of its checkpoint modules, which must all agree: a fused layer runs in one format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.quantization.base import FusedMoEMethod, LinearMethod, QuantizationConfig
from tokenmill.quantization.detect import QuantSpec
from tokenmill.quantization.format_base import CheckpointFormat, EngineChoices
from tokenmill.quantization.registry import FORMATS
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod

ROUTERS = ("*.gate", "*.shared_expert_gate")
"""Model modules of MoE routers and one-row gates: on-load quantization leaves them as they are."""

CheckpointNames = Callable[[str], list[str]]
"""A model module's path -> the checkpoint modules whose tensors load into it (none: a tied head)."""


def excluded(module: str, patterns: Iterable[str]) -> bool:
    """Whether a checkpoint module matches an exclusion: "re:" + a regex matched at its start
    (compressed-tensors), else an fnmatch glob (ModelOpt), the module itself, a parent of it, or
    its trailing dotted names (modules_to_not_convert: "lm_head", "mlp.gate")."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif fnmatch(module, pattern) or module.startswith(pattern + ".") or f".{module}".endswith(f".{pattern}"):
            return True
    return False


class CheckpointQuantization(QuantizationConfig):
    """The layers of a checkpoint described by `spec`, each in its format or unquantized."""

    name = "checkpoint"

    def __init__(self, spec: QuantSpec, use_triton: bool = False, checkpoint_names: CheckpointNames | None = None,
                 choices: EngineChoices = EngineChoices()) -> None:
        self.spec = spec
        self.use_triton = use_triton
        self.choices = choices
        self.checkpoint_names = checkpoint_names or (lambda prefix: [prefix])
        self._formats: dict[str, CheckpointFormat] = {}
        for settings in [spec.settings] if spec.settings is not None else spec.layers.values():
            self._format(settings)  # every format the checkpoint names is built (or refused) now
        self.name = "+".join(sorted({f.quant_algo for f in self._formats.values()}))

    def _format(self, settings: dict[str, Any]) -> CheckpointFormat:
        key = json.dumps({k: v for k, v in settings.items() if k != "where"}, sort_keys=True, default=str)
        if key not in self._formats:
            algo = settings["quant_algo"]
            cls = FORMATS.get(algo)
            if cls is None:
                raise ConfigError(f"{settings.get('where', 'quant_algo')} = {algo!r}: this build of tokenmill does not "
                                  f"read {algo} layers; it reads {', '.join(FORMATS)} (and MIXED_PRECISION maps of them)")
            self._formats[key] = cls.from_settings(settings, self.use_triton, self.choices)
        return self._formats[key]

    @property
    def formats(self) -> list[CheckpointFormat]:
        """Every format the checkpoint names."""
        return list(self._formats.values())

    def format_of(self, module: str) -> CheckpointFormat | None:
        """The format of one checkpoint module (None: unquantized)."""
        if excluded(module, self.spec.exclude):
            return None
        if self.spec.settings is not None:
            return self._format(self.spec.settings)
        entry = self.spec.layers.get(module)
        return self._format(entry) if entry is not None else None

    def route(self, prefix: str) -> CheckpointFormat | None:
        """The format of model module `prefix`, from the checkpoint modules that load into it."""
        chosen = {name: self.format_of(name) for name in self.checkpoint_names(prefix)}
        formats = {id(f): f for f in chosen.values()}
        if len(formats) > 1:
            described = ", ".join(f"{name}: {f.name if f else 'unquantized'}" for name, f in chosen.items())
            raise ConfigError(f"{prefix} fuses checkpoint layers stored in different formats ({described}); tokenmill "
                              "runs a fused layer in one format: quantize them alike")
        return next(iter(formats.values()), None)

    def linear_method(self, prefix: str) -> LinearMethod:
        found = self.route(prefix)
        return found.linear_method(prefix) if found is not None else UnquantizedLinearMethod(self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        found = self.route(prefix)
        return found.experts_method(prefix) if found is not None else UnquantizedFusedMoEMethod(self.use_triton)

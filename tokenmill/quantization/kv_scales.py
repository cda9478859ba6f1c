"""Per-layer FP8 KV-cache scales: read from a checkpoint, or calibrated once at start-up.

An FP8 E4M3 cache stores k / k_scale (and v / v_scale), saturated at +-448. E4M3 keeps 3
mantissa bits wherever a value is normal (|x| >= 2^-6), so the scale only decides which values
saturate at the top and which fall into the subnormals at the bottom.

Checkpoints name the scales `<layer>.self_attn.k_scale` (compressed-tensors),
`.self_attn.attn.k_scale` (vLLM), `.self_attn.k_proj.k_scale` (ModelOpt), `.self_attn.kv_scale`
(older: one scale for both) or `.self_attn.k_proj.output_scale` (older compressed-tensors); a
per-head scale becomes its largest head's, so no head saturates.

Calibration records amax(|k|) and amax(|v|) per layer as the attention backend receives them
(after q/k norm and rotary) in one forward over a fixed text, and sets scale = amax /
CALIBRATION_TARGET: HEADROOM below E4M3's maximum, so served text may hold K/V up to HEADROOM
times the calibration text's before anything saturates.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.numerics import FP8_E4M3, FP8_E4M3_MAX

logger = logging.getLogger(__name__)

HEADROOM = 4.0
CALIBRATION_TARGET = FP8_E4M3_MAX / HEADROOM
CALIBRATION_TOKENS = 1024

_KV_SCALE = re.compile(r"(?P<attn>.+\.self_attn)\.(?:attn\.|[kv]_proj\.)?(?P<which>k|v|kv)_scale")
_KV_OUTPUT_SCALE = re.compile(r"(?P<attn>.+\.self_attn)\.(?P<which>k|v)_proj\.output_scale")
# Scales of FP8 attention (query, probabilities): tokenmill quantizes only the KV cache.
_UNUSED_SCALE = re.compile(r".+\.self_attn\.(?:attn\.)?(?:q|prob)_scale")


class ScaledKVLayer(Protocol):
    """An attention layer with an FP8-capable KV cache."""

    k_scale: float
    v_scale: float
    checkpoint_kv_scales: tuple[float, float] | None
    backend: Any
    kv_cache: torch.Tensor


class CheckpointKVScales:
    """Collects a checkpoint's KV-scale tensors while the model loads the rest."""

    def __init__(self) -> None:
        self.scales: dict[str, dict[str, float]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """True when `name` is a KV (or unused attention) scale, recorded here."""
        if _UNUSED_SCALE.fullmatch(name):
            return True
        match = _KV_SCALE.fullmatch(name) or _KV_OUTPUT_SCALE.fullmatch(name)
        if not match:
            return False
        which = match["which"]
        for kind in ("k", "v") if which == "kv" else (which,):
            self.scales.setdefault(match["attn"], {})[kind] = _scale_value(name, tensor)
        return True

    def apply(self, model: nn.Module) -> None:
        """Record the scales on each layer (`checkpoint_kv_scales`); they take effect only when a
        runner with an FP8 cache copies them to k_scale / v_scale."""
        for path, given in self.scales.items():
            try:
                attention = model.get_submodule(path)
            except AttributeError:
                attention = None
            if not hasattr(attention, "checkpoint_kv_scales"):
                raise ModelLoadError(f"checkpoint KV scales for {path!r} have no attention layer in {type(model).__name__}")
            if set(given) != {"k", "v"}:
                raise ModelLoadError(f"{path}: the checkpoint has a {next(iter(given))}_scale but no "
                                     f"{'v' if 'k' in given else 'k'}_scale; FP8 KV needs both")
            attention.checkpoint_kv_scales = (given["k"], given["v"])


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() == 0:
        raise ModelLoadError(f"{name}: an empty KV scale tensor")
    value = float(tensor.float().max())
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{name}: KV scale {value} must be finite and positive")
    return value


def scale_for(amax: float) -> float:
    """The scale that puts amax at CALIBRATION_TARGET; 1.0 for a layer whose values are all zero."""
    return amax / CALIBRATION_TARGET if amax > 0 else 1.0


def set_kv_scales(
    layers: Sequence[ScaledKVLayer], kv_dtype: torch.dtype, mode: bool | None,
    measure: Callable[[], tuple[list[tuple[float, float]], int, str]],
) -> None:
    """Give every layer the scales it serves with. mode: None = calibrate the layers without
    checkpoint scales, True = calibrate all, False = the checkpoint's, else 1.0. `measure` runs the
    calibration forward: ((amax k, amax v) per layer, tokens, what they were). Call before CUDA
    graphs are captured (they bake the scales into their launches)."""
    given = [layer for layer in layers if layer.checkpoint_kv_scales is not None]
    if kv_dtype != FP8_E4M3:
        if given:
            logger.info("the checkpoint's FP8 KV scales are ignored: the KV cache is %s", kv_dtype)
        return
    todo = layers if mode else [layer for layer in layers if layer.checkpoint_kv_scales is None]
    for layer in layers:
        layer.k_scale, layer.v_scale = layer.checkpoint_kv_scales or (1.0, 1.0)
    if given and not mode:
        logger.info("FP8 KV: scales of %d of %d layers from the checkpoint", len(given), len(layers))
    if not todo:
        return
    if mode is False:
        logger.warning(
            "FP8 KV: %d of %d layers have no scales in the checkpoint and --no-calculate-kv-scales keeps "
            "them at 1.0; K/V values below 2^-6 lose precision (drop the flag to calibrate)", len(todo), len(layers))
        return
    amax, num_tokens, what = measure()
    for layer, (k_amax, v_amax) in zip(layers, amax):
        if mode or layer.checkpoint_kv_scales is None:
            layer.k_scale, layer.v_scale = scale_for(k_amax), scale_for(v_amax)
    k_scales = [layer.k_scale for layer in todo]
    v_scales = [layer.v_scale for layer in todo]
    logger.info(
        "FP8 KV: calibrated the scales of %d layers on %d tokens of %s (amax / %g): k_scale %.3g..%.3g, "
        "v_scale %.3g..%.3g", len(todo), num_tokens, what, CALIBRATION_TARGET,
        min(k_scales), max(k_scales), min(v_scales), max(v_scales))


class AmaxRecorder:
    """Stands in for one layer's attention backend: records amax(|k|), amax(|v|) and attends over
    a model-dtype scratch cache."""

    name = "amax-recorder"
    attends_prewritten_cache = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.amax: list[torch.Tensor] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        self.amax.append(torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()]))
        # The scratch cache is in the model dtype: the layer's FP8 scales must not apply to it.
        return self.inner.forward(q, k, v, kv_cache, metadata, scale, 1.0, 1.0)


def recorded_kv_amax(
    layers: Sequence[ScaledKVLayer], scratch_caches: Sequence[torch.Tensor], forward: Callable[[], None], dtype: torch.dtype
) -> list[tuple[float, float]]:
    """(amax |k|, amax |v|) per layer over one forward. Each layer attends over its scratch cache;
    its KV tensor and backend are put back afterwards (also on error), so nothing of this forward
    can be read by a request."""
    saved = [(layer.kv_cache, layer.backend) for layer in layers]
    recorders = [AmaxRecorder(layer.backend) for layer in layers]
    try:
        for layer, recorder, scratch in zip(layers, recorders, scratch_caches):
            layer.kv_cache, layer.backend = scratch, recorder
        forward()
    finally:
        for layer, (cache, backend) in zip(layers, saved):
            layer.kv_cache, layer.backend = cache, backend
    if any(len(r.amax) != 1 for r in recorders):
        raise RuntimeError("KV-scale calibration expects each attention layer to run exactly once per forward")
    amax = torch.stack([r.amax[0] for r in recorders]).tolist()
    for i, (k, v) in enumerate(amax):
        if not (math.isfinite(k) and math.isfinite(v)):
            raise ConfigError(f"KV-scale calibration: layer {i} produced non-finite keys or values in {dtype}; "
                              "try another --dtype, or --no-calculate-kv-scales")
    return [(k, v) for k, v in amax]

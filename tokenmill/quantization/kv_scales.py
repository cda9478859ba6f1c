"""Per-layer FP8 KV-cache scales: read from a checkpoint, or calibrated once at start-up.

A cache layer whose cache may be FP8 E4M3 (a `ScaledCacheLayer`) stores each scaled part of its
cache as x / that part's scale, saturated at +-448: a full-attention layer's keys (k_scale) and
values (v_scale), an MLA layer's latent row (one scale). E4M3 keeps 3 mantissa bits wherever a
value is normal (|x| >= 2^-6), so a scale only decides which values saturate at the top and
which fall into the subnormals at the bottom.

Checkpoints name the scales `<layer>.self_attn.k_scale` (compressed-tensors),
`.self_attn.attn.k_scale` or `.self_attn.mla_attn.k_scale` (vLLM), `.self_attn.k_proj.k_scale`
or, for MLA, `.self_attn.kv_a_proj_with_mqa.k_scale` (ModelOpt), `.self_attn.kv_scale` (older:
one scale for both) or `.self_attn.k_proj.output_scale` (older compressed-tensors); a per-head
scale becomes its largest head's, so no head saturates. Each layer turns the k / v scales it is
given into its own (`key_value_scales`, `latent_scale`).

Calibration records the amax of each scaled part per layer over one forward into scratch caches
in the model dtype (what the layer stores: after q/k norm and rotary, or the normalised latent
and rotated k_pe), and sets scale = amax / CALIBRATION_TARGET: HEADROOM below E4M3's maximum, so
served text may hold values up to HEADROOM times the calibration text's before any saturates.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.numerics import FP8_E4M3, FP8_E4M3_MAX

logger = logging.getLogger(__name__)

HEADROOM = 4.0
CALIBRATION_TARGET = FP8_E4M3_MAX / HEADROOM
CALIBRATION_TOKENS = 1024

_KV_SCALE = re.compile(
    r"(?P<attn>.+\.self_attn)\.(?:attn\.|mla_attn\.|[kv]_proj\.|kv_a_proj_with_mqa\.)?(?P<which>k|v|kv)_scale")
_KV_OUTPUT_SCALE = re.compile(r"(?P<attn>.+\.self_attn)\.(?P<which>k|v)_proj\.output_scale")
# Scales of FP8 attention (query, probabilities): tokenmill quantizes only the KV cache.
_UNUSED_SCALE = re.compile(r".+\.self_attn\.(?:attn\.|mla_attn\.)?(?:q|prob)_scale")


class ScaledCacheLayer(Protocol):
    """A cache layer whose cache may be FP8: one scale per scaled part of its cache spec
    (`PagedCacheSpec.scaled_parts`), a Python float each, baked into every launch."""

    kv_cache: torch.Tensor  # the bound cache tensor
    kv_scales: tuple[float, ...]  # the scales it serves with (1.0 for a model-dtype cache)
    # As the checkpoint gives them; the runner applies them to an FP8 cache only.
    checkpoint_kv_scales: tuple[float, ...] | None

    def cache_spec(self) -> Any: ...

    def bind_cache(self, cache: torch.Tensor) -> None: ...

    def scales_from_checkpoint(self, path: str, given: Mapping[str, float]) -> tuple[float, ...]:
        """This layer's scales from the checkpoint's {"k": k_scale, "v": v_scale} (either may be
        missing); raise ModelLoadError when they cannot serve."""
        ...


def key_value_scales(path: str, given: Mapping[str, float]) -> tuple[float, float]:
    """A full-attention layer's (k_scale, v_scale): both must be given."""
    if set(given) != {"k", "v"}:
        raise ModelLoadError(f"{path}: the checkpoint has a {next(iter(given))}_scale but no "
                             f"{'v' if 'k' in given else 'k'}_scale; FP8 KV needs both")
    return given["k"], given["v"]


def latent_scale(path: str, given: Mapping[str, float]) -> tuple[float]:
    """An MLA layer's latent-row scale: the row is the key (latent || k_pe) and its value part
    (the latent) is inside it, so k_scale covers it; with a v_scale too, the larger of the two."""
    if "k" not in given:
        raise ModelLoadError(f"{path}: the checkpoint has a v_scale but no k_scale; an FP8 latent cache "
                             "is scaled by the key's")
    return (max(given.values()),)


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
        runner with an FP8 cache copies them to kv_scales."""
        for path, given in self.scales.items():
            try:
                layer = model.get_submodule(path)
            except AttributeError:
                layer = None
            if not hasattr(layer, "checkpoint_kv_scales"):
                raise ModelLoadError(f"checkpoint KV scales for {path!r} have no attention layer in {type(model).__name__}")
            layer.checkpoint_kv_scales = layer.scales_from_checkpoint(path, given)


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
    layers: Sequence[ScaledCacheLayer], kv_dtype: torch.dtype, mode: bool | None,
    measure: Callable[[], tuple[list[tuple[float, ...]], int, str]],
) -> None:
    """Give every layer the scales it serves with. mode: None = calibrate the layers without
    checkpoint scales, True = calibrate all, False = the checkpoint's, else 1.0. `measure` runs the
    calibration forward: (amax of each scaled part per layer, tokens, what they were). Call before
    CUDA graphs are captured (they bake the scales into their launches)."""
    given = [layer for layer in layers if layer.checkpoint_kv_scales is not None]
    if kv_dtype != FP8_E4M3:
        if given:
            logger.info("the checkpoint's FP8 KV scales are ignored: the KV cache is %s", kv_dtype)
        return
    todo = layers if mode else [layer for layer in layers if layer.checkpoint_kv_scales is None]
    for layer in layers:
        layer.kv_scales = layer.checkpoint_kv_scales or (1.0,) * len(layer.kv_scales)
    if given and not mode:
        logger.info("FP8 KV: scales of %d of %d layers from the checkpoint", len(given), len(layers))
    if not todo:
        return
    if mode is False:
        logger.warning(
            "FP8 KV: %d of %d layers have no scales in the checkpoint and --no-calculate-kv-scales keeps "
            "them at 1.0; cached values below 2^-6 lose precision (drop the flag to calibrate)", len(todo), len(layers))
        return
    amax, num_tokens, what = measure()
    for layer, part_amax in zip(layers, amax):
        if mode or layer.checkpoint_kv_scales is None:
            layer.kv_scales = tuple(scale_for(a) for a in part_amax)
    scales = [s for layer in todo for s in layer.kv_scales]
    logger.info("FP8 KV: calibrated the scales of %d layers on %d tokens of %s (amax / %g): %.3g..%.3g",
                len(todo), num_tokens, what, CALIBRATION_TARGET, min(scales), max(scales))


def recorded_cache_amax(
    layers: Sequence[ScaledCacheLayer], scratch_caches: Sequence[torch.Tensor],
    scratch_parts: Sequence[Sequence[torch.Tensor]], forward: Callable[[], None], dtype: torch.dtype,
) -> list[tuple[float, ...]]:
    """The amax of each scaled part per layer over one forward. Each layer is bound its scratch
    cache (model dtype; `scratch_parts` are its scaled parts) with scales 1.0, and its own cache
    and scales are put back afterwards (also on error), so nothing of this forward can be read by
    a request."""
    saved = [(layer.kv_cache, layer.kv_scales) for layer in layers]
    try:
        for layer, scratch in zip(layers, scratch_caches):
            layer.bind_cache(scratch)
            layer.kv_scales = (1.0,) * len(layer.kv_scales)
        forward()
    finally:
        for layer, (cache, scales) in zip(layers, saved):
            layer.bind_cache(cache)
            layer.kv_scales = scales
    amax = [torch.stack([part.abs().amax().float() for part in parts]).tolist() for parts in scratch_parts]
    for i, part_amax in enumerate(amax):
        if not all(math.isfinite(a) for a in part_amax):
            raise ConfigError(f"KV-scale calibration: cache layer {i} stored non-finite values in {dtype}; "
                              "try another --dtype, or --no-calculate-kv-scales")
    return [tuple(a) for a in amax]

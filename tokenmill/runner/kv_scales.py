"""Per-layer FP8 KV-cache scales: the checkpoint's, or calibrated once at start-up.

An FP8 E4M3 cache stores k / k_scale (and v / v_scale), saturated at +-448. E4M3 keeps 3
mantissa bits wherever a value is normal (|x| >= 2^-6), so the scale only decides which values
saturate at the top and which fall into the subnormals at the bottom; at scale 1.0 a layer
whose values are ~0.01 keeps one or two bits (SmolLM2's first layer, benchmarks/RESULTS.md).

Calibration runs one forward in the model dtype over a fixed text (the start of Newton's
Opticks, the corpus shipped for `tokenmill bench`) into a scratch cache, records amax(|k|) and
amax(|v|) per layer as the attention backend receives them (after q/k norm and rotary), and
sets scale = amax / CALIBRATION_TARGET.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.models.loader import CheckpointSource, load_tokenizer
from tokenmill.runner.batch import Chunk, pack

if TYPE_CHECKING:
    from tokenmill.models.llama import LlamaForCausalLM
    from tokenmill.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
# The calibrated amax lands at 448 / 4: served text may hold K/V up to 4x larger than the
# calibration text's before anything saturates, and values down to amax / 7168 (= 112 / 2^-6)
# stay normal, which is below anything that moves attention.
HEADROOM = 4.0
CALIBRATION_TARGET = FP8_E4M3_MAX / HEADROOM
CALIBRATION_TOKENS = 1024
_RANDOM_IDS_SEED = 0


def configure_kv_scales(runner: ModelRunner, source: CheckpointSource) -> None:
    """Give every attention layer the KV scales it serves with. Call before CUDA graphs are
    captured (graphs bake the scales into their launches) and before anything is served."""
    layers = runner.model.attention_layers()
    mode = runner.config.cache.calculate_kv_scales
    given = [layer for layer in layers if layer.checkpoint_kv_scales is not None]
    if runner.kv_dtype != torch.float8_e4m3fn:
        if given:
            logger.info("the checkpoint's FP8 KV scales are ignored: the KV cache is %s", runner.kv_dtype)
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
    budget = min(CALIBRATION_TOKENS, runner.config.model.max_model_len, runner.config.scheduler.max_num_batched_tokens)
    token_ids, what = calibration_token_ids(source, runner.vocab_size, budget)
    amax = measure_kv_amax(runner.model, token_ids, runner.block_size, runner.dtype, runner.device)
    for layer, (k_amax, v_amax) in zip(layers, amax):
        if mode or layer.checkpoint_kv_scales is None:
            layer.k_scale, layer.v_scale = scale_for(k_amax), scale_for(v_amax)
    k_scales = [layer.k_scale for layer in todo]
    v_scales = [layer.v_scale for layer in todo]
    logger.info(
        "FP8 KV: calibrated the scales of %d layers on %d tokens of %s (amax / %g): k_scale %.3g..%.3g, "
        "v_scale %.3g..%.3g", len(todo), len(token_ids), what, CALIBRATION_TARGET,
        min(k_scales), max(k_scales), min(v_scales), max(v_scales))


def scale_for(amax: float) -> float:
    """The scale that puts amax at CALIBRATION_TARGET; 1.0 for a layer whose values are all zero."""
    return amax / CALIBRATION_TARGET if amax > 0 else 1.0


def calibration_token_ids(source: CheckpointSource, vocab_size: int, max_tokens: int) -> tuple[list[int], str]:
    """(token ids, what they are): the corpus text through the model's tokenizer (with its special
    tokens, as a text prompt gets them), else seeded random ids for a model without a tokenizer."""
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(_RANDOM_IDS_SEED)
        return torch.randint(vocab_size, (max_tokens,), generator=generator).tolist(), "seeded random ids (no tokenizer)"
    from tokenmill.bench.corpus import read_corpus_text

    text = read_corpus_text()[: 16 * max_tokens]  # no tokenizer packs more than 16 characters per token
    ids = [t for t in tokenizer(text).input_ids if 0 <= t < vocab_size][:max_tokens]
    return ids, "Newton's Opticks"


class _AmaxRecorder(AttentionBackend):
    """Wraps one layer's backend: records amax(|k|), amax(|v|) and attends over a model-dtype cache."""

    name = "amax-recorder"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.amax: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        self.amax.append(torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()]))
        # The scratch cache is in the model dtype: the layer's FP8 scales must not apply to it.
        return self.inner.forward(q, k, v, kv_cache, metadata, scale, 1.0, 1.0)


@torch.inference_mode()
def measure_kv_amax(
    model: LlamaForCausalLM, token_ids: list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[float, float]]:
    """(amax |k|, amax |v|) per attention layer over one sequence of token_ids.

    Each layer attends over a scratch cache of its own; its KV tensor and backend are put back
    afterwards, so nothing of this forward can be read by a request."""
    layers = model.attention_layers()
    n = len(token_ids)
    if n == 0:
        raise ConfigError("the KV-scale calibration text has no tokens")
    blocks = -(-n // block_size)
    saved = [(layer.kv_cache, layer.backend) for layer in layers]
    recorders = [_AmaxRecorder(layer.backend) for layer in layers]
    try:
        for layer, recorder in zip(layers, recorders):
            shape = layer.backend.kv_cache_shape(blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend = recorder
        model(*pack([Chunk(token_ids, 0, range(blocks))], block_size, device))
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

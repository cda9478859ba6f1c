"""The configuration of a DFlash / DFlash2 block drafter, read from its checkpoint's config.json.

Layout followed: z-lab/dflash (`DFlashDraftModel`, `DFlash2DraftModel` in dflash/model.py) and
the published drafters' config.json: a Qwen3-style decoder config (`hidden_size`,
`num_hidden_layers`, heads, `head_dim`, `rope_theta`, ...) with `architectures`
["DFlashDraftModel"] or ["DFlash2DraftModel"], `block_size` (top level or in `dflash_config`),
`num_target_layers` and `dflash_config` {target_layer_ids, mask_token_id; DFlash2 adds
conv_kernel_size, conv_group_size, selector_rank, selector_top_k}; `input_embedding_scale`,
`output_multiplier` and `final_logit_softcapping` are read from `dflash_config` or the top
level with upstream's defaults (1, 1, none). `target_layer_ids` defaults to upstream's
`build_target_layer_ids(num_target_layers, num_hidden_layers)`. `layer_types` may mix
full_attention and sliding_attention layers (window: `sliding_window`, or vLLM's
dflash_config.swa_window_size / use_swa), causal as upstream decides (`is_causal`, else sliding
layers causal). Everything the drafters of vLLM and SGLang read beyond that (attention sinks, a
separate mask embedding, a draft-to-target vocabulary map, drafters without fc) is refused at
start-up, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from tokenmill.errors import ConfigError

DFLASH, DFLASH2 = "dflash", "dflash2"
ARCHITECTURES = {"DFlashDraftModel": DFLASH, "DFlash2DraftModel": DFLASH2}
KNOWN_DFLASH_KEYS = frozenset({
    "block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "use_aux_hidden_state", "causal",
    "use_swa", "swa_window_size", "attention_sink_bias", "input_embedding_scale", "output_multiplier",
    "final_logit_softcapping",
})
LAYER_TYPES = ("full_attention", "sliding_attention")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class ConvShape:
    """DFlash2's grouped dynamic causal convolutions: `taps` taps, `group` channels per dynamic kernel."""

    taps: int
    group: int


@dataclass(frozen=True)
class SelectorShape:
    rank: int
    top_k: int


@dataclass(frozen=True)
class LayerAttention:
    """One drafter layer's attention: causal or not within the block, and a sliding window (0: none)."""

    causal: bool
    window: int


@dataclass(frozen=True)
class DFlashSpec:
    kind: str  # DFLASH or DFLASH2
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    target_hidden_size: int  # width of one tapped target layer (fc reads len(target_layer_ids) of them)
    layers: tuple[LayerAttention, ...]  # per drafter layer
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    conv: ConvShape | None  # DFlash2 only
    selector: SelectorShape | None  # DFlash2 only


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Upstream's default taps: spread from layer 1 to layer num_target_layers - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def read_dflash_spec(config: PretrainedConfig, method: str, raw: dict[str, Any] | None = None) -> DFlashSpec:
    """The drafter's spec; ConfigError naming the field for anything tokenmill cannot honour.
    `raw`: config.json as written (transformers' config classes may drop `sliding_window` when
    `use_sliding_window` is off; the file's values are read first)."""
    architectures = list(getattr(config, "architectures", None) or [])
    kinds = [ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES]
    if not kinds:
        raise ConfigError(f"the {method} method needs a DFlash drafter checkpoint (architectures DFlashDraftModel or "
                          f"DFlash2DraftModel); this one has architectures {architectures}")
    kind = kinds[0]
    if kind != method:
        raise ConfigError(f"the draft checkpoint is a {kind} drafter ({architectures[0]}); use \"method\": \"{kind}\"")
    section: dict[str, Any] = dict(getattr(config, "dflash_config", None) or {})
    unknown = sorted(set(section) - KNOWN_DFLASH_KEYS - set(DFLASH2_KEYS))
    if unknown:
        raise ConfigError(f"dflash_config sets {unknown}, which tokenmill does not read; it knows "
                          f"{sorted(KNOWN_DFLASH_KEYS | set(DFLASH2_KEYS))}")

    def value(name: str, default: Any = None) -> Any:
        return section.get(name, getattr(config, name, default))

    _refuse_unsupported(config, section, value)
    layers = int(config.num_hidden_layers)
    ids = value("target_layer_ids")
    if ids is None:
        targets = value("num_target_layers")
        if targets is None:
            raise ConfigError("the drafter's config has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = build_target_layer_ids(int(targets), layers)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"dflash_config.target_layer_ids must be a non-empty list of layer indices, not {ids!r}")
    mask = value("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise ConfigError(f"dflash_config.mask_token_id must be a token id, not {mask!r}")
    block = _positive(value("block_size", 16), "block_size")
    conv = selector = None
    if kind == DFLASH2:
        taps, group, rank, top_k = (_positive(section.get(k, getattr(config, k, None)), f"dflash_config.{k}")
                                    for k in DFLASH2_KEYS)
        if config.hidden_size % group:
            raise ConfigError(f"dflash_config.conv_group_size {group} does not divide hidden_size {config.hidden_size}")
        if taps > block:
            raise ConfigError(f"dflash_config.conv_kernel_size {taps} exceeds block_size {block}")
        if top_k > config.vocab_size:
            raise ConfigError(f"dflash_config.selector_top_k {top_k} exceeds the vocabulary ({config.vocab_size})")
        conv, selector = ConvShape(taps, group), SelectorShape(rank, top_k)
    elif any(k in section for k in DFLASH2_KEYS):
        raise ConfigError(f"dflash_config sets {[k for k in DFLASH2_KEYS if k in section]} of a DFlash2 drafter but the "
                          "architecture is DFlashDraftModel")
    softcap = value("final_logit_softcapping")
    return DFlashSpec(kind, block, tuple(int(i) for i in ids), mask,
                      int(getattr(config, "target_hidden_size", None) or config.hidden_size),
                      _layer_attention(config, section, raw or {}, layers, block),
                      float(value("input_embedding_scale", 1.0)), float(value("output_multiplier", 1.0)),
                      float(softcap) if softcap is not None and float(softcap) > 0 else None, conv, selector)


def _layer_attention(config: PretrainedConfig, section: dict[str, Any], raw: dict[str, Any], layers: int,
                     block: int) -> tuple[LayerAttention, ...]:
    """Each layer's attention, upstream's rule: `is_causal` (or dflash_config.causal, vLLM's key)
    for every layer when given, else sliding-window layers causal and full-attention layers not;
    a sliding layer's window is dflash_config.swa_window_size or sliding_window (vLLM's
    `use_swa` makes every layer one). A non-causal window narrower than the block would hide the
    block's later rows from its first ones, which tokenmill does not implement: refused."""
    types = list(raw.get("layer_types") or getattr(config, "layer_types", None) or ["full_attention"] * layers)
    if section.get("use_swa"):
        types = ["sliding_attention"] * layers
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types {types}: one of {LAYER_TYPES} per drafter layer ({layers}) is read")
    explicit = section.get("causal", raw.get("is_causal", getattr(config, "is_causal", None)))
    window = section.get("swa_window_size", raw.get("sliding_window", getattr(config, "sliding_window", None)))
    out = []
    for kind in types:
        causal = kind == "sliding_attention" if explicit is None else bool(explicit)
        size = 0
        if kind == "sliding_attention":
            size = _positive(window, "sliding_window (or dflash_config.swa_window_size) of sliding_attention layers")
            if not causal and size < block:
                raise ConfigError(f"sliding_window {size} is narrower than the block ({block}) of a non-causal layer")
        out.append(LayerAttention(causal, size))
    return tuple(out)


def _refuse_unsupported(config: PretrainedConfig, section: dict[str, Any], value: Any) -> None:
    if section.get("attention_sink_bias") or getattr(config, "add_swa_attention_sink_bias", False):
        raise ConfigError("attention_sink_bias: drafter attention sinks are not implemented")
    if section.get("use_aux_hidden_state", True) is not True:
        raise ConfigError("use_aux_hidden_state false (a drafter without fc over the target's layers) is not implemented")
    if getattr(config, "draft_vocab_size", None) not in (None, config.vocab_size):
        raise ConfigError(f"draft_vocab_size {config.draft_vocab_size}: a drafter with its own vocabulary map (d2t) is "
                          "not implemented; use draft_vocab in --speculative-config")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {config.hidden_act!r}: block drafters run SiLU MLPs")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor {config.partial_rotary_factor}: block drafters rotate whole heads")


def refuse_extra_files(path: Path | None) -> None:
    """A separately trained mask embedding (vLLM's `mask_embedding.pt`) is not read: refuse it."""
    if path is not None and (path / "mask_embedding.pt").is_file():
        raise ConfigError(f"{path / 'mask_embedding.pt'}: a separate mask embedding is not implemented")


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, not {value!r}")
    return value

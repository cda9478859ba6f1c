"""Tiny random checkpoints with MTP heads, and references of the MTP math built from transformers'
own decoder layers (transformers' models ignore `mtp.*`, so nothing in transformers runs them).

The head's tensors are written as the published checkpoints lay them out: Qwen3-Next / Qwen3.5
`mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}` and `mtp.layers.0.*`; DeepSeek-V3
`model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens}` and
the decoder layer beside them; Qwen4Exp `mtp.{fc_embedding, fc_hidden, pre_fc_norm_embedding,
pre_fc_norm_hidden, hyper_connection_mixer.*}` and `mtp.layers.0.*`. The decoder layer is
transformers' own: a model of one more layer (a full-attention one) is built and saved by
`save_pretrained` (per-expert keys, as real checkpoints), and its last layer's tensors are
renamed into the head's. That layer, in memory, is the reference's.

`mode="copy"` makes a target that is nearly a bigram model (its blocks' outputs scaled down)
and a head that passes the next token's embedding through (fc = [I, 0], its block's outputs
zeroed), so the head predicts what the target will say after the next token: most drafts
are accepted, some are not, and both sides of verification run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


@dataclass
class MTPCheckpoint:
    path: Path
    target: nn.Module  # transformers' model of the target, float32
    layer: nn.Module  # transformers' decoder layer of the head (index num_hidden_layers of a longer model)
    extras: dict[str, torch.Tensor]  # the head's own tensors beside its layer, by checkpoint name


@torch.no_grad()
def scale_block_outputs_(model: nn.Module, factor: float) -> None:
    for name, p in model.named_parameters():
        if name.endswith(OUTPUT_PROJECTIONS):
            p.mul_(factor)


def _longer_config(config: PretrainedConfig, layer_type: str | None) -> PretrainedConfig:
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = config.num_hidden_layers + 1
    if layer_type is not None:
        longer.layer_types = list(config.layer_types) + [layer_type]
    return longer


def build_head_layer(config: PretrainedConfig, layer_type: str | None, seed: int, randomize, make=None
                     ) -> tuple[nn.Module, dict[str, torch.Tensor], Path]:
    """(transformers' layer N of a model one layer longer, its saved tensors by name, where saved)."""
    import tempfile

    torch.manual_seed(seed)
    longer = _longer_config(config, layer_type)
    model = make(longer) if make is not None else AutoModelForCausalLM.from_config(longer, dtype=torch.float32)
    randomize(model, seed)
    where = Path(tempfile.mkdtemp(prefix="mtp-layer-"))
    model.save_pretrained(where)
    tensors = {}
    for file in sorted(where.glob("*.safetensors")):
        tensors.update(load_file(file))
    return model.float().eval().model.layers[config.num_hidden_layers], tensors, where


def write_head(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add the head's tensors to a saved single-file checkpoint."""
    file = path / "model.safetensors"
    saved = load_file(file)
    saved.update({name: t.contiguous() for name, t in tensors.items()})
    save_file(saved, str(file), metadata={"format": "pt"})


def norm_weight(size: int, generator: torch.Generator, centre: float) -> torch.Tensor:
    return torch.randn(size, generator=generator) * 0.1 + centre


def qwen_mtp_checkpoint(name: str, path: Path, configs: dict, randomize, *, seed: int = 0, mode: str = "random",
                        extra_tensors=None, make=None, layer_type: str = "full_attention"
                        ) -> MTPCheckpoint:
    """A Qwen-family target (Qwen3-Next / Qwen3.5 / Qwen4Exp) saved with an `mtp.*` head."""
    config = copy.deepcopy(configs[name])
    config.mtp_num_hidden_layers = 1
    torch.manual_seed(seed)
    target = make(config) if make is not None else AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(target, seed)
    if mode == "copy":
        scale_block_outputs_(target, 0.1)
    target.save_pretrained(path)
    layer, saved, _ = build_head_layer(configs[name], layer_type, seed + 1, randomize, make)
    prefix = f"model.layers.{config.num_hidden_layers}."
    head = {"mtp.layers.0." + n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
    if mode == "copy":
        for n in head:
            if n.endswith(OUTPUT_PROJECTIONS):
                head[n] = torch.zeros_like(head[n])
        scale_block_outputs_(layer, 0.0)
    g = torch.Generator().manual_seed(seed + 2)
    extras_of = extra_tensors or qwen3_next_extras
    extras = extras_of(config, g, mode, target)
    write_head(path, {**head, **extras})
    return MTPCheckpoint(path, target.float().eval(), layer, extras)


def qwen3_next_extras(config: PretrainedConfig, g: torch.Generator, mode: str, target: nn.Module
                      ) -> dict[str, torch.Tensor]:
    """Random (1 + w) norms and fc; "copy": the embedding through the target's final norm, fc = [I, 0]."""
    hidden = config.hidden_size
    fc = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    embedding_norm = norm_weight(hidden, g, 0.0)
    if mode == "copy":
        fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1) + 0.01 * fc
        embedding_norm = target.model.norm.weight.detach().clone()
    return {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": embedding_norm,
            "mtp.pre_fc_norm_hidden.weight": norm_weight(hidden, g, 0.0),
            "mtp.norm.weight": norm_weight(hidden, g, 0.0) * (0.0 if mode == "copy" else 1.0)}


def zero_centered_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def plain_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def causal_mask(length: int) -> torch.Tensor:
    """[1, 1, T, T] additive mask of a causal sequence (what an eager attention takes)."""
    mask = torch.full((length, length), float("-inf")).triu(1)
    return mask[None, None]

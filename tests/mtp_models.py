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

OUTPUT_PROJECTIONS = ("o_proj.weight", "o_proj.bias", "out_proj.weight", "down_proj.weight", "down_proj.bias",
                      "experts.down_proj", "value_proj.weight")


@dataclass
class MTPCheckpoint:
    path: Path
    target: nn.Module  # transformers' model of the target, float32
    layer: nn.Module  # transformers' decoder layer of the head (index num_hidden_layers of a longer model)
    extras: dict[str, torch.Tensor]  # the head's own tensors beside its layer, by checkpoint name
    longer: nn.Module  # that longer model (Qwen4Exp: its final mixer is the head's)


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
    return model.float().eval(), tensors, where


def write_head(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add the head's tensors to a saved single-file checkpoint."""
    file = path / "model.safetensors"
    saved = load_file(file)
    saved.update({name: t.contiguous() for name, t in tensors.items()})
    save_file(saved, str(file), metadata={"format": "pt"})


def norm_weight(size: int, generator: torch.Generator, centre: float) -> torch.Tensor:
    return torch.randn(size, generator=generator) * 0.1 + centre


def qwen_mtp_checkpoint(name: str, path: Path, configs: dict, randomize, *, seed: int = 0, mode: str = "random",
                        extra_tensors=None, make=None, layer_type: str = "full_attention",
                        scale: float | None = None) -> MTPCheckpoint:
    """A Qwen-family target (Qwen3-Next / Qwen3.5 / Qwen4Exp) saved with an `mtp.*` head."""
    config = copy.deepcopy(configs[name])
    config.mtp_num_hidden_layers = 1
    torch.manual_seed(seed)
    target = make(config) if make is not None else AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(target, seed)
    if mode == "copy":
        scale_block_outputs_(target, scale or 0.1)
    target.save_pretrained(path)
    longer, saved, _ = build_head_layer(configs[name], layer_type, seed + 1, randomize, make)
    layer = longer.model.layers[config.num_hidden_layers]
    prefix = f"model.layers.{config.num_hidden_layers}."
    head = {"mtp.layers.0." + n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
    if mode == "copy":
        for n in head:
            if n.endswith(OUTPUT_PROJECTIONS):
                head[n] = torch.zeros_like(head[n])
        scale_block_outputs_(layer, 0.0)
    g = torch.Generator().manual_seed(seed + 2)
    extras_of = extra_tensors or qwen3_next_extras
    extras = extras_of(config, g, mode, target, saved)
    write_head(path, {**head, **extras})
    return MTPCheckpoint(path, target.float().eval(), layer, extras, longer)


def qwen3_next_extras(config: PretrainedConfig, g: torch.Generator, mode: str, target: nn.Module,
                      saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def qwen4exp_extras(config: PretrainedConfig, g: torch.Generator, mode: str, target: nn.Module,
                    saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Random fc_embedding / fc_hidden / (1 + w) norms and the longer model's final mixer as the
    head's; "copy": the embedding into every stream and the target's own mixer."""
    hidden, wide = config.hidden_size, config.hidden_size * config.hc_count
    mixer = {"mtp." + n[len("model."):]: t for n, t in saved.items() if n.startswith("model.hyper_connection_mixer.")}
    extras = {"mtp.fc_embedding.weight": torch.randn(hidden, hidden, generator=g) * 0.1,
              "mtp.fc_hidden.weight": torch.randn(hidden, hidden, generator=g) * 0.1,
              "mtp.pre_fc_norm_embedding.weight": norm_weight(hidden, g, 0.0),
              "mtp.pre_fc_norm_hidden.weight": norm_weight(wide, g, 0.0), **mixer}
    if mode == "copy":
        extras["mtp.fc_embedding.weight"] = torch.eye(hidden)
        extras["mtp.fc_hidden.weight"] *= 0.1
        extras["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
        extras.update({"mtp." + n[len("model."):]: t.detach().clone() for n, t in target.state_dict().items()
                       if n.startswith("model.hyper_connection_mixer.")})
    return extras


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


@torch.no_grad()
def randomize_deepseek_(model: nn.Module, seed: int) -> None:
    """tests/deepseek_models.py's scales: biases N(0, 0.1), norms N(1, 0.1), matrices N(0, 0.08)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, 0.1)
        elif p.dim() == 1:
            p.normal_(1.0, 0.1)
        else:
            p.normal_(0.0, 0.08)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)


def deepseek_mtp_checkpoint(config: PretrainedConfig, path: Path, *, seed: int = 0, mode: str = "random",
                            scale: float | None = None) -> MTPCheckpoint:
    """A DeepSeek-V3 target saved with its MTP layer as `model.layers.{N}` (copies of the target's
    head and embedding beside it, as DeepSeek-V3's release has them)."""
    config = copy.deepcopy(config)
    config.num_nextn_predict_layers = 1
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_deepseek_(target, seed)
    if mode == "copy":  # DeepSeek's blocks write more than the Qwen configs' beside an embedding of 0.08
        scale_block_outputs_(target, scale or 0.05)
    target.save_pretrained(path)
    longer, saved, _ = build_head_layer(config, None, seed + 1, randomize_deepseek_)
    layer = longer.model.layers[config.num_hidden_layers]
    n, hidden = config.num_hidden_layers, config.hidden_size
    prefix = f"model.layers.{n}."
    head = {name: t for name, t in saved.items() if name.startswith(prefix)}
    if mode == "copy":
        head = {name: torch.zeros_like(t) if name.endswith(OUTPUT_PROJECTIONS) else t for name, t in head.items()}
        scale_block_outputs_(layer, 0.0)
    g = torch.Generator().manual_seed(seed + 2)
    eh_proj = torch.randn(hidden, 2 * hidden, generator=g) * 0.08
    enorm = norm_weight(hidden, g, 1.0)
    if mode == "copy":
        eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1) + 0.01 * eh_proj
        enorm = target.model.norm.weight.detach().clone()
    extras = {f"{prefix}eh_proj.weight": eh_proj, f"{prefix}enorm.weight": enorm,
              f"{prefix}hnorm.weight": norm_weight(hidden, g, 1.0),
              f"{prefix}shared_head.norm.weight": torch.ones(hidden) if mode == "copy" else norm_weight(hidden, g, 1.0)}
    copies = {f"{prefix}shared_head.head.weight": target.lm_head.weight.detach().clone(),
              f"{prefix}embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
    write_head(path, {**head, **extras, **copies})
    return MTPCheckpoint(path, target.float().eval(), layer, extras, longer)

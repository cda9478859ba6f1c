"""Tiny random targets (dense Llama, Qwen3-MoE, the Qwen3-Next hybrid) and DFlash / DFlash2 drafter
checkpoints written in the published layout (config.json with dflash_config, safetensors of
fc / hidden_norm / layers / norm and DFlash2's convolutions and candidate selector), and a dense
PyTorch reference of the drafters' math after z-lab/dflash's model.py (context keys and values
concatenated before the block's, one softmax over both, rotary over the whole sequence).

"Repeat" checkpoints make greedy drafts right part of the time: the target's output head leans
towards the token it reads (its head is its embedding, scaled, plus noise), so it mostly
repeats tokens and at times moves on; its embedding carries a marker channel (MARK) in every
token but the drafter's mask token. The "copy" drafter attends from every mask row to the
block's anchor alone (the only key with the marker: head 0's queries and keys read it, on a
rotary pair that barely turns) and writes the anchor's embedding into the row, so through the
shared head it drafts the anchor at every position: drafts are accepted along a run of
repeats, rejected where the target moves on, and whole blocks are accepted at times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from hybrid_models import HYBRID_CONFIGS, randomize_hybrid_
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3MoeConfig

TARGET_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
    "llama-v8": LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None),
    "qwen3_moe": Qwen3MoeConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                experts_implementation="eager", tie_word_embeddings=False, bos_token_id=None,
                                eos_token_id=None),
    "qwen3_next": HYBRID_CONFIGS["qwen3_next"],
}
ZERO_CENTRED = {"qwen3_next"}  # final norm x * (1 + w)


@dataclass
class Drafter:
    config: dict
    tensors: dict[str, torch.Tensor]


MARK = 0  # the embedding's marker channel (every token but the mask token)
# How hard a target's head leans towards the token it reads (runs of repeats, broken often enough).
REPEAT = {"qwen3_next": 8.0}
EMBEDDING_SCALE = {"qwen3_next": 2.0}


def save_target(name: str, path: Path, seed: int = 0, repeat: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    config = TARGET_CONFIGS[name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if name in HYBRID_CONFIGS:
            randomize_hybrid_(model, seed)
        else:
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 0.15) + (p.dim() == 1))
        if repeat:
            embedding = model.get_input_embeddings().weight
            embedding *= EMBEDDING_SCALE.get(name, 1.0)  # the token read dominates the final residual
            embedding[:, MARK] = 0.2
            embedding[config.vocab_size - 1, MARK] = 0.0  # the drafters' mask token
            unmarked = embedding.clone()
            unmarked[:, MARK] = 0.0
            head = model.lm_head.weight
            head.copy_(head + REPEAT.get(name, 2.0) * unmarked / unmarked.norm(dim=1, keepdim=True))
            head[:, MARK] = 0.0
    model.save_pretrained(path)
    return model.eval()


def drafter(target: PretrainedConfig, kind: str = "dflash", *, seed: int = 1, layers: int = 2, block_size: int = 8,
            target_layer_ids: tuple[int, ...] = (0, 2), copy_from: torch.Tensor | None = None, top_k: int = 3,
            rank: int = 8, taps: int = 2, group: int = 8, **config: object) -> Drafter:
    """A drafter for `target` in the published layout (its hidden size the target's); random, or
    with `copy_from` (the target's embedding) the copy drafter of the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab, heads, kv_heads, head_dim, inter = target.hidden_size, target.vocab_size, 4, 2, 16, 64

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + rand(size)

    tensors = {"fc.weight": rand(hidden, len(target_layer_ids) * hidden, std=0.15), "hidden_norm.weight": norm(hidden),
               "norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": norm(hidden), f"{p}.post_attention_layernorm.weight": norm(hidden),
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, hidden, std=0.2),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, std=0.2),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden, std=0.2),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * head_dim, std=0.2),
            f"{p}.self_attn.q_norm.weight": norm(head_dim), f"{p}.self_attn.k_norm.weight": norm(head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden, std=0.2), f"{p}.mlp.up_proj.weight": rand(inter, hidden, std=0.2),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter, std=0.2),
        })
        if kind == "dflash2":
            for conv in ("attention_conv", "mlp_conv"):
                base = rand(2, taps, hidden, std=0.3)
                base[:, 0] += 1.0
                tensors[f"{p}.{conv}.base_kernel"] = base
                tensors[f"{p}.{conv}.kernel_projection.weight"] = rand(2 * taps * (hidden // group), hidden, std=0.2)
    section: dict = {"target_layer_ids": list(target_layer_ids), "mask_token_id": vocab - 1}
    if kind == "dflash2":
        section.update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
        tensors["candidate_selector.hidden_projection.weight"] = rand(rank, hidden, std=0.3)
        tensors["candidate_selector.predecessor_codebook"] = rand(vocab, rank, std=0.8)
        tensors["candidate_selector.successor_codebook"] = rand(vocab, rank, std=0.8)
    if copy_from is not None:
        _make_copying(tensors, copy_from, layers, head_dim)
    cfg = {"architectures": ["DFlashDraftModel" if kind == "dflash" else "DFlash2DraftModel"], "model_type": "qwen3",
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "rope_theta": 1e9 if copy_from is not None else 10000.0, "max_position_embeddings": 256, "block_size": block_size,
           "num_target_layers": target.num_hidden_layers, "tie_word_embeddings": False, "dflash_config": section}
    cfg.update(config)
    return Drafter(cfg, tensors)


def _make_copying(t: dict[str, torch.Tensor], embedding: torch.Tensor, layers: int, head_dim: int) -> None:
    """Head 0 of layer 0 copies the anchor's embedding into every mask row (module docstring);
    every other sublayer's output is nearly zero, the convolutions near their identity."""
    hidden = embedding.shape[1]
    mask_row = embedding[-1] / embedding[-1].pow(2).mean().sqrt()  # the mask row after an input norm of ones
    marker = head_dim // 2 - 1  # the rotary pair that turns slowest
    copied = slice(1, 1 + head_dim)
    for i in range(layers):
        p = f"layers.{i}"
        for name, tensor in list(t.items()):
            if name.startswith(f"{p}.") and tensor.dim() == 2 and "conv" not in name:
                t[name] = tensor * 0.01
            elif name.startswith(f"{p}.") and tensor.dim() == 1:
                t[name] = torch.ones_like(tensor)
        for name in [n for n in t if n.startswith(f"{p}.") and "conv." in n]:  # near the identity
            t[name] = t[name] * 0.05
            if name.endswith("base_kernel"):
                t[name][:, 0] = 1.0
    a = "layers.0.self_attn"
    t[f"{a}.q_proj.weight"][marker] = mask_row / mask_row.norm()
    t[f"{a}.k_proj.weight"][:head_dim] = 0.0  # kv head 0's keys: the marker alone (zero for unmarked rows)
    t[f"{a}.k_proj.weight"][marker, MARK] = 1.0
    t[f"{a}.q_norm.weight"][marker] = t[f"{a}.k_norm.weight"][marker] = 3.0
    v, o = t[f"{a}.v_proj.weight"], t[f"{a}.o_proj.weight"]
    v[:head_dim] = 0.0
    v[torch.arange(head_dim), torch.arange(copied.start, copied.stop)] = 1.0
    o[:, :head_dim] = 0.0
    o[torch.arange(copied.start, copied.stop), torch.arange(head_dim)] = 10.0
    t["hidden_norm.weight"][MARK] = 0.0  # the context has no marker
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        if name in t:  # transitions that reorder close candidates only
            t[name] = t[name] * 0.4
    t["norm.weight"] = torch.ones(hidden)


def save_drafter(d: Drafter, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d.config))
    save_file({k: v.contiguous() for k, v in d.tensors.items()}, str(path / "model.safetensors"))
    return path


# ---- the reference ---------------------------------------------------------------------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """upstream's _grouped_dynamic_convolve over one block: x [L, H], dynamic [L, taps, G], base [taps, H]."""
    length, hidden = x.shape
    blocks = x.view(length, hidden // group, group)
    out = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(hidden // group, group) * values + dynamic[:, offset, :, None] * values
    return out.view_as(x)


@torch.no_grad()
def reference_block(target: nn.Module, d: Drafter, known: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-norm rows 1..width-1 [width - 1, H], their logits) of the block anchored at known[-1]
    over the context of known[:-1], computed densely as upstream's DFlashDraftModel does."""
    cfg, t = d.config, d.tensors
    section, eps, theta = cfg["dflash_config"], cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    states = target(torch.tensor([known[:-1]]), output_hidden_states=True).hidden_states
    feature = torch.cat([states[i + 1][0] for i in section["target_layer_ids"]], dim=-1)
    context = _rms(feature @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    n = context.shape[0]
    ids = torch.tensor([known[-1]] + [section["mask_token_id"]] * (width - 1))
    x = target.get_input_embeddings().weight[ids] * float(section.get("input_embedding_scale", 1.0))
    q_pos, k_pos = torch.arange(n, n + width), torch.arange(n + width)
    taps = section.get("conv_kernel_size")
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"

        def sublayer(h: torch.Tensor, conv: str, body) -> torch.Tensor:
            if taps is None:
                return body(h)
            groups = cfg["hidden_size"] // section["conv_group_size"]
            dynamic = (h @ t[f"{p}.{conv}.kernel_projection.weight"].T).view(width, 2, taps, groups)
            base = t[f"{p}.{conv}.base_kernel"]
            h = _conv(h, dynamic[:, 0], base[0], section["conv_group_size"])
            return _conv(body(h), dynamic[:, 1], base[1], section["conv_group_size"])

        def attention(h: torch.Tensor) -> torch.Tensor:
            a = f"{p}.self_attn"
            q = _rms((h @ t[f"{a}.q_proj.weight"].T).view(width, heads, head_dim), t[f"{a}.q_norm.weight"], eps)
            both = torch.cat([context, h])
            k = _rms((both @ t[f"{a}.k_proj.weight"].T).view(-1, kv_heads, head_dim), t[f"{a}.k_norm.weight"], eps)
            v = (both @ t[f"{a}.v_proj.weight"].T).view(-1, kv_heads, head_dim)
            q, k = _rope(q, q_pos, theta), _rope(k, k_pos, theta)
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
            sliding = types[i] == "sliding_attention"  # upstream's _attention_mask
            causal = sliding if cfg.get("is_causal") is None else bool(cfg["is_causal"])
            visible = torch.ones(width, n + width, dtype=torch.bool)
            if causal:
                visible &= k_pos[None] <= q_pos[:, None]
            if sliding:
                window = cfg["sliding_window"]
                visible &= (q_pos[:, None] - k_pos[None] < window) & (causal or (k_pos[None] - q_pos[:, None] < window))
            scores = scores.masked_fill(~visible, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(width, -1)
            return out @ t[f"{a}.o_proj.weight"].T

        def mlp(h: torch.Tensor) -> torch.Tensor:
            m = f"{p}.mlp"
            return (F.silu(h @ t[f"{m}.gate_proj.weight"].T) * (h @ t[f"{m}.up_proj.weight"].T)) @ t[f"{m}.down_proj.weight"].T

        x = x + sublayer(_rms(x, t[f"{p}.input_layernorm.weight"], eps), "attention_conv", attention)
        x = x + sublayer(_rms(x, t[f"{p}.post_attention_layernorm.weight"], eps), "mlp_conv", mlp)
    out = _rms(x, t["norm.weight"], eps)[1:]
    return out, out @ target.lm_head.weight.T


def reference_walk(d: Drafter, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
    """DFlash2's greedy walk (upstream's CandidateSelector.select at temperature 0)."""
    t, top_k = d.tensors, d.config["dflash_config"]["selector_top_k"]
    unary, candidates = logits.topk(top_k, dim=-1)
    projected = hidden @ t["candidate_selector.hidden_projection.weight"].T
    previous, path = anchor, []
    for position in range(hidden.shape[0]):
        context = t["candidate_selector.predecessor_codebook"][previous] * projected[position]
        scores = unary[position] + t["candidate_selector.successor_codebook"][candidates[position]] @ context
        previous = int(candidates[position, scores.argmax()])
        path.append(previous)
    return path

"""Shared by the MLA tests: tiny DeepSeek-V2 / V3 / Kimi-Linear attention configs, the
transformers reference layers with random weights, and a paged-step driver for tokenmill's layer."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from tokenmill.layers.attention.backend import AttentionMetadata
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.attention.mla_backends import MLABackend
from tokenmill.layers.attention.mla_rotary import RopeStyle
from tokenmill.layers.step_context import StepContext

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=12, num_hidden_layers=1)
# DeepSeek-V2-Lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707), over a tiny original context.
V2_LITE_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
# mscale != mscale_all_dim: the cos/sin themselves are scaled (attention_factor != 1).
SCALED_YARN = dict(V2_LITE_YARN, mscale=1.0, mscale_all_dim=0.5)


@dataclass(frozen=True)
class Case:
    family: str  # "v2", "v3" or "kimi"
    config: object
    rope: RopeStyle | None  # what the model's own file passes to MLAAttention


CASE_NAMES = ["v2-no-q-lora-yarn", "v3-q-lora-interleaved-yarn-bias", "v3-q-lora-neox", "kimi-nope"]
# transformers' modules per family: imported when a case is built (a transformers without one
# of them fails that case's tests, not every test of the module).
FAMILY_MODULES = {"v2": "deepseek_v2", "v3": "deepseek_v3", "kimi": "kimi_linear"}
ATTENTION_CLASSES = {"v2": "DeepseekV2Attention", "v3": "DeepseekV3Attention", "kimi": "KimiLinearAttention"}


def hf_module(family: str, suffix: str = "modeling") -> ModuleType:
    return importlib.import_module(f"transformers.models.{FAMILY_MODULES[family]}.{suffix}_{FAMILY_MODULES[family]}")


def mla_case(name: str) -> Case:
    if name == "v2-no-q-lora-yarn":
        config = hf_module("v2", "configuration").DeepseekV2Config(
            **SHAPE, q_lora_rank=None, max_position_embeddings=2560, rope_parameters=V2_LITE_YARN)
        return Case("v2", config, "interleaved")
    if name == "v3-q-lora-interleaved-yarn-bias":
        config = hf_module("v3", "configuration").DeepseekV3Config(
            **SHAPE, q_lora_rank=24, max_position_embeddings=2560, rope_parameters=SCALED_YARN, rope_interleave=True,
            attention_bias=True)
        return Case("v3", config, "interleaved")
    if name == "v3-q-lora-neox":
        return Case("v3", hf_module("v3", "configuration").DeepseekV3Config(**SHAPE, q_lora_rank=24, rope_interleave=False),
                    "neox")
    if name == "kimi-nope":
        return Case("kimi", hf_module("kimi", "configuration").KimiLinearConfig(**SHAPE, q_lora_rank=None), None)
    raise KeyError(name)


def hf_attention(case: Case, seed: int = 0) -> nn.Module:
    case.config._attn_implementation = "eager"
    module = getattr(hf_module(case.family), ATTENTION_CLASSES[case.family])(case.config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return module


@torch.no_grad()
def hf_forward(case: Case, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' layer on one whole sequence x [N, hidden], causal: [N, hidden]."""
    n = x.shape[0]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    positions = torch.arange(n)[None]
    hidden = x[None]
    if case.family == "v2":
        rotary = hf_module("v2").DeepseekV2RotaryEmbedding(case.config)(hidden, positions)
        out, _ = module(hidden, attention_mask=mask, position_embeddings=rotary)
    elif case.family == "v3":
        rotary = hf_module("v3").DeepseekV3RotaryEmbedding(case.config)(hidden, positions)
        out, _ = module(hidden, position_embeddings=rotary, attention_mask=mask)
    else:
        out, _ = module(hidden, attention_mask=mask)
    return out[0]


def our_attention(case: Case, hf: nn.Module, backend: MLABackend | None = None,
                  cache_dtype: torch.dtype | None = None, block_size: int = 4) -> MLAAttention:
    ours = MLAAttention(case.config, case.rope, backend, cache_dtype=cache_dtype, block_size=block_size)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours.eval()


@dataclass
class PagedPool:
    """Requests own shuffled, disjoint blocks of one pool (as a long-running engine's would)."""

    num_blocks: int
    block_size: int
    seed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(self.seed)).tolist()

    def add(self, max_tokens: int) -> int:
        blocks = -(-max_tokens // self.block_size)
        self.tables.append(self.free[:blocks])
        self.free = self.free[blocks:]
        self.computed.append(0)
        return len(self.tables) - 1

    def step(self, items: list[tuple[int, int]], device: str = "cpu") -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions, metadata) of one step that runs q_len new tokens of each (request, q_len)."""
        positions, slots, starts, seq_lens = [], [], [0], []
        for req, q_len in items:
            table, done = self.tables[req], self.computed[req]
            for p in range(done, done + q_len):
                positions.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            starts.append(starts[-1] + q_len)
            seq_lens.append(done + q_len)
            self.computed[req] = done + q_len
        width = max(len(self.tables[r]) for r, _ in items)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _ in items]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_host=[q for _, q in items],
            seq_lens_host=seq_lens,
        )
        return torch.tensor(positions, dtype=torch.long, device=device), metadata


@torch.no_grad()
def run_schedule(ours: MLAAttention, pool: PagedPool, cache: torch.Tensor, xs: list[torch.Tensor],
                 schedule: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
    """Every request's outputs, its steps' rows concatenated, running `schedule` step by step."""
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for items in schedule:
        rows = [xs[req][pool.computed[req] : pool.computed[req] + q_len] for req, q_len in items]
        positions, metadata = pool.step(items, device=str(cache.device))
        ours.bind_cache(cache)
        y = ours(torch.cat(rows), StepContext(positions, metadata))
        start = 0
        for (req, q_len) in items:
            outs[req].append(y[start : start + q_len])
            start += q_len
    return [torch.cat(o) for o in outs]

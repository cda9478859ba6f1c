"""Tiny random Qwen4Exp text configs and helpers shared by the layer and model tests."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention, Qwen4ExpTextRotaryEmbedding

from tokenmill.kv.planner import allocate_caches
from tokenmill.kv.specs import CacheLayer
from tokenmill.layers.attention import ATTENTION_BACKENDS
from tokenmill.layers.attention.qsa_backends import QSABackend
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import ModelBuild
from tokenmill.models.llama import PACKED
from tokenmill.models.qwen3_next import rotary_dim
from tokenmill.models.qwen4_exp import IndexedAttention
from tokenmill.models.weights import load_checkpoint


def tiny_config(**overrides: object) -> Qwen4ExpTextConfig:
    """Every Qwen4Exp part at toy sizes: 3 GDN layers and one QSA layer (n_v != n_k), 3 streams,
    PLE on layers 1 and 2, a QSA budget of 8 tokens in blocks of 4, partial rotary."""
    fields: dict[str, object] = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hc_count=3, hc_lowrank=8, ple_layer_ids=[1, 2], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=50, split_ngram_parts=4, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=8, indexer_compress_ratio=4, eos_token_id=3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    fields.update(overrides)
    config = Qwen4ExpTextConfig(**fields)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_(module: nn.Module, seed: int, scale: float = 0.3) -> None:
    """Every floating parameter drawn anew (zero-initialised norm weights and convs included)."""
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        if param.is_floating_point():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)


class ChunkedRun:
    """Requests of the given lengths computed a few tokens at a time, packed together, the way the
    engine runs them: each owns shuffled disjoint KV blocks and a state slot that is not its index."""

    def __init__(self, lengths: list[int], block_size: int, chunk_sizes: tuple[int, ...] = (5, 1, 8), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lengths, self.block_size, self.chunk_sizes = lengths, block_size, chunk_sizes
        needed = [-(-n // block_size) for n in lengths]
        order = torch.randperm(sum(needed) + 2, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for n in needed:
            self.tables.append(order[:n])
            order = order[n:]
        self.num_blocks = sum(needed) + 2
        self.slots = torch.randperm(len(lengths) + 1, generator=gen)[: len(lengths)].tolist()
        self.num_slots = len(lengths) + 1

    def steps(self) -> list[list[tuple[int, int, int]]]:
        """Per step, (request, start, end) of each request that advances; requests step in turn
        with chunk sizes cycling through chunk_sizes (offset per request), so chunks cross blocks."""
        done = [0] * len(self.lengths)
        steps, k = [], 0
        while any(d < n for d, n in zip(done, self.lengths)):
            step = []
            for r, n in enumerate(self.lengths):
                if done[r] < n:
                    size = self.chunk_sizes[(k + r) % len(self.chunk_sizes)]
                    step.append((r, done[r], min(n, done[r] + size)))
                    done[r] = step[-1][2]
            steps.append(step)
            k += 1
        return steps

    def context(self, step: list[tuple[int, int, int]]):
        from tokenmill.layers.attention import AttentionMetadata
        from tokenmill.layers.step_context import StepContext

        positions = [p for _, start, end in step for p in range(start, end)]
        qsl = [0]
        for _, start, end in step:
            qsl.append(qsl[-1] + end - start)
        width = max(len(self.tables[r]) for r, _, _ in step)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _, _ in step]
        slot_mapping = [self.tables[r][p // self.block_size] * self.block_size + p % self.block_size
                        for r, start, end in step for p in range(start, end)]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor([end for _, _, end in step], dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            query_lens_host=[end - start for _, start, end in step],
            seq_lens_host=[end for _, _, end in step],
        )
        return StepContext(torch.tensor(positions), metadata,
                           state_slots=torch.tensor([self.slots[r] for r, _, _ in step]))


def qsa_reference(theirs: Qwen4ExpTextAttention, config, x: torch.Tensor) -> torch.Tensor:
    """transformers over one whole sequence x [S, hidden], no cache."""
    seq = x.shape[0]
    positions = torch.arange(seq)[None]
    cos_sin = Qwen4ExpTextRotaryEmbedding(config)(x[None], positions)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        return theirs(x[None], cos_sin, mask, cache=None)[0][0]


def build_qsa(config, block_size: int, qsa: QSABackend | None = None, seed: int = 0,
              cache_dtype: torch.dtype | None = None) -> tuple[Qwen4ExpTextAttention, IndexedAttention]:
    """transformers' attention with random weights, and ours loaded from its state dict (the
    `qsa` backend in place of the torch one when given)."""
    theirs = Qwen4ExpTextAttention(config, layer_idx=3)
    randomize_(theirs, seed=seed)
    backend = ATTENTION_BACKENDS["torch"]()
    build = ModelBuild(config, backend, max_model_len=512, block_size=block_size, kv_cache_dtype=cache_dtype)
    rotary = RotaryEmbedding(config, config.head_dim, 512, rotary_dim=rotary_dim(config))
    ours = IndexedAttention(build, rotary, "self_attn")
    if qsa is not None:
        ours.qsa = ours.indexer.backend = qsa
    load_checkpoint(ours, theirs.state_dict().items(), PACKED)
    return theirs, ours


def run_qsa_chunked(ours: IndexedAttention, run: ChunkedRun, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, CacheLayer)}
    allocate_caches(layers, run.num_blocks + 1, run.num_slots + 1, "cpu")
    ours.kv_cache.fill_(9.0)  # stale caches: nothing may be read before it is written
    ours.indexer.index_cache.fill_(9.0)
    if ours.indexer.window is not None:
        ours.indexer.window.keys.fill_(9.0)
    got = [torch.empty_like(x) for x in inputs]
    with torch.no_grad():
        for step in run.steps():
            out = ours(torch.cat([inputs[r][a:b] for r, a, b in step]), run.context(step))
            row = 0
            for r, a, b in step:
                got[r][a:b] = out[row : row + b - a]
                row += b - a
    return got

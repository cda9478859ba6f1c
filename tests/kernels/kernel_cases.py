"""Shared by the kernel tests: which device a case runs on, and paged-batch builders."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tokenmill.layers.attention import AttentionMetadata

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available() and not INTERPRETING


def on_cpu(*values: object, id: str | None = None):
    """A tiny case, run through the interpreter on CPU (CI)."""
    return pytest.param(*values, "cpu", id=id, marks=pytest.mark.skipif(not INTERPRETING, reason="interpreter off"))


def on_gpu(*values: object, id: str | None = None):
    """A realistic case, run on CUDA (marked gpu)."""
    return pytest.param(
        *values, "cuda", id=id, marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
    )


@dataclass
class PagedBatch:
    metadata: AttentionMetadata
    num_blocks: int


def paged_batch(
    requests: list[tuple[int, int]],  # (query_len, seq_len) per request
    block_size: int,
    device: torch.device | str,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Packed metadata whose requests own shuffled, disjoint blocks (as a long-running pool would)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for _, seq_len in requests]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts = [], [], [0]
    for (q_len, seq_len), n in zip(requests, needed):
        table, order = order[:n], order[n:]
        tables.append(table)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len))
        starts.append(starts[-1] + q_len)
    width = max(needed)
    padded = [t + [0] * (width - len(t)) for t in tables]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_host=[q for q, _ in requests],
        seq_lens_host=[s for _, s in requests],
    )
    return PagedBatch(metadata, num_blocks)

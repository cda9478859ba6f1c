"""Packing requests' new tokens into one flat batch with its paged-attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.step_context import StepContext
from tokenmill.transfer import to_device


@dataclass
class Chunk:
    """Tokens of one request computed in one forward, starting at position `start`."""

    token_ids: list[int]
    start: int
    block_table: Sequence[int]


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The flat KV slot of a request's token at `position`."""
    return block_table[position // block_size] * block_size + position % block_size


def flat_block_tables(tables: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """(the tables row after row, zero-padded to the longest, that width)."""
    width = max(len(t) for t in tables)
    return [b for t in tables for b in (*t, *[0] * (width - len(t)))], width


def pack(chunks: Sequence[Chunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata); request i's rows end at metadata.query_start_loc[i + 1].

    Two uploads in all (one int64 buffer, one int32 buffer) whose slices are the tensors."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    for chunk in chunks:
        end = chunk.start + len(chunk.token_ids)
        table = chunk.block_table
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start, end))
        slots.extend(slot_of(table, p, block_size) for p in range(chunk.start, end))
        query_start.append(query_start[-1] + len(chunk.token_ids))
        seq_lens.append(end)
    tables, width = flat_block_tables([c.block_table for c in chunks])
    tokens, batch = len(input_ids), len(chunks)
    wide = to_device(input_ids + positions + slots, torch.int64, device)
    narrow = to_device(query_start + seq_lens + tables, torch.int32, device)
    metadata = AttentionMetadata(
        query_start_loc=narrow[: batch + 1],
        seq_lens=narrow[batch + 1 : 2 * batch + 1],
        block_tables=narrow[2 * batch + 1 :].view(batch, width),
        slot_mapping=wide[2 * tokens :],
        query_lens_host=[len(c.token_ids) for c in chunks],
        seq_lens_host=seq_lens,
    )
    return wide[:tokens], wide[tokens : 2 * tokens], metadata


def pack_context(chunks: Sequence[Chunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, StepContext]:
    """(input ids, the forward's context) of `pack`."""
    ids, positions, metadata = pack(chunks, block_size, device)
    return ids, StepContext(positions, metadata)

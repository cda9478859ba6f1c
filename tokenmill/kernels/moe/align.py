"""The slots of a batch sorted by expert, each expert's run padded to the grouped GEMM's row block.

A slot is one (token, choice) pair: slot s = token * k + j holds topk_ids[token, j]. The
grouped GEMMs (grouped_gemm.py) read rows in this order, so that every BLOCK_M-row block belongs
to one expert:

    counts[e]       slots that chose expert e
    starts[e]       where expert e's run begins; runs are padded to multiples of BLOCK_M, so
                    starts[e + 1] - starts[e] = ceil(counts[e] / BLOCK_M) * BLOCK_M and
                    starts[E] is the padded total
    sorted_slots[p] the slot at position p, for starts[e] <= p < starts[e] + counts[e]; the
                    padding positions are never read

Three small kernels, no host sync, every buffer sized from T * k (CUDA-graph safe): counts by
per-chunk histograms added atomically; starts by one program's cumulative sum; then each slot's
place is its run's start plus a rank taken with an atomic increment. The ranks make the order
inside a run vary from run to run, which no result depends on: a GEMM row's value does not
depend on its place in the block, and each slot's output goes back to the slot's own row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_pow2

CHUNK = 1024  # slots per program of the count and place kernels


@dataclass(frozen=True)
class SlotLayout:
    counts: torch.Tensor  # int32 [E]
    starts: torch.Tensor  # int32 [E + 1]
    sorted_slots: torch.Tensor  # int32 [padded_capacity(...)]
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.sorted_slots.numel() // self.block_m


def padded_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    """Positions the sorted slots can need at most: every expert that has slots adds at most one
    partial block, and at most min(E, slots) experts have any."""
    return (triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)) * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, num_experts, CHUNK: tl.constexpr, BINS: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=num_experts)  # bin E: beyond the batch
    hist = tl.histogram(ids, BINS)
    bins = tl.arange(0, BINS)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < num_experts) & (hist > 0))


@triton.jit
def _starts_kernel(counts_ptr, starts_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    tl.store(starts_ptr + 1 + experts, ends, mask=experts < num_experts)
    tl.store(starts_ptr, 0)


@triton.jit
def _place_kernel(ids_ptr, starts_ptr, cursor_ptr, sorted_ptr, num_slots, CHUNK: tl.constexpr):
    slots = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = slots < num_slots
    ids = tl.load(ids_ptr + slots, mask=ok, other=0)
    rank = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
    place = tl.load(starts_ptr + ids, mask=ok, other=0) + rank
    tl.store(sorted_ptr + place, slots, mask=ok)


def align_slots(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SlotLayout:
    """The slots of topk_ids [T, k] (int32) sorted by expert in runs padded to block_m."""
    num_slots = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    device = topk_ids.device
    counters = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
    counts, cursor = counters[0], counters[1]
    starts = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    sorted_slots = torch.empty(padded_capacity(num_slots, num_experts, block_m), dtype=torch.int32, device=device)
    chunks = (triton.cdiv(num_slots, CHUNK),)
    _count_kernel[chunks](ids, counts, num_slots, num_experts, CHUNK=CHUNK, BINS=next_pow2(num_experts + 1),
                          num_warps=4)
    _starts_kernel[(1,)](counts, starts, num_experts, BLOCK_M=block_m, BLOCK_E=next_pow2(num_experts), num_warps=4)
    _place_kernel[chunks](ids, starts, cursor, sorted_slots, num_slots, CHUNK=CHUNK, num_warps=4)
    return SlotLayout(counts, starts, sorted_slots, block_m)


def align_slots_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, starts) of the layout, by torch."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    return counts.to(torch.int32), starts.to(torch.int32)

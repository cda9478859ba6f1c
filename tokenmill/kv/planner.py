"""Sizing and allocating every cache from the layers' specs: one byte formula, one allocator."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenmill.errors import ConfigError
from tokenmill.kv.specs import CacheLayer, CacheSpec, PagedCacheSpec, RecurrentStateSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    """How many paged blocks and state slots the caches hold: slots for running requests
    (`state_slots_per_seq` each), then prefix-cache snapshot slots. Allocation adds one scratch
    block and one scratch slot beyond them, which padded CUDA-graph rows write into and no request owns."""

    num_blocks: int
    num_state_slots: int
    block_size: int
    bytes_per_block: int
    bytes_per_state_slot: int
    num_snapshot_slots: int = 0
    state_slots_per_seq: int = 1

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def first_snapshot_slot(self) -> int:
        return self.num_state_slots

    @property
    def scratch_slot(self) -> int:
        return self.num_state_slots + self.num_snapshot_slots

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshot_slots * self.bytes_per_state_slot


def paged_block_size(specs: Mapping[str, CacheSpec], default: int) -> int:
    """The one block size every paged layer shares (they share block ids)."""
    sizes = {s.block_size for s in specs.values() if isinstance(s, PagedCacheSpec)}
    if len(sizes) > 1:
        raise ConfigError(f"paged cache layers disagree on the block size ({sorted(sizes)}); they share block ids")
    return sizes.pop() if sizes else default


def bytes_per_block(specs: Mapping[str, CacheSpec]) -> int:
    return sum(s.bytes_per_block() for s in specs.values() if isinstance(s, PagedCacheSpec))


def bytes_per_state_slot(specs: Mapping[str, CacheSpec]) -> int:
    return sum(s.bytes_per_slot() for s in specs.values() if isinstance(s, RecurrentStateSpec))


def states_write_checkpoints(specs: Mapping[str, CacheSpec]) -> bool:
    return all(s.writes_checkpoints for s in specs.values() if isinstance(s, RecurrentStateSpec))


def plan_caches(
    specs: Mapping[str, CacheSpec], budget: int, block_size: int, max_model_len: int, max_num_seqs: int,
    state_slots_per_seq: int = 1, snapshot_bytes: int | None = 0,
) -> CachePlan:
    """State slots for max_num_seqs requests first (state_slots_per_seq each: speculative decoding
    keeps spares), then the snapshot pool of hybrid prefix caching (snapshot_bytes; None = a
    quarter of the budget), then as many blocks as the rest of the budget holds. Fails closed when
    one request of max_model_len could never fit."""
    block_size = paged_block_size(specs, block_size)
    per_block, per_slot = bytes_per_block(specs), bytes_per_state_slot(specs)
    if per_slot and state_slots_per_seq > 1 and not states_write_checkpoints(specs):
        raise ConfigError("speculative decoding rolls recurrent state back to a draft position, which this model's "
                          "recurrent layers keep no checkpoints for; drop --speculative-config")
    num_slots = max_num_seqs * state_slots_per_seq if per_slot else 0
    state_bytes = (num_slots + 1) * per_slot if per_slot else 0
    if state_bytes > budget:
        raise ConfigError(
            f"the recurrent state of --max-num-seqs {max_num_seqs} requests ({state_slots_per_seq} slots each) needs "
            f"{state_bytes / 2**30:.2f} GiB but the cache budget is {budget / 2**30:.2f} GiB; lower --max-num-seqs "
            "(or --mamba-ssm-cache-dtype bfloat16) or raise the cache budget")
    num_snapshots = 0
    if per_slot and states_write_checkpoints(specs):
        wanted = budget // 4 if snapshot_bytes is None else snapshot_bytes
        num_snapshots = min(wanted, budget - state_bytes) // per_slot
        state_bytes += num_snapshots * per_slot
    num_blocks = (budget - state_bytes) // per_block if per_block else 0
    capacity = num_blocks * block_size
    if per_block and capacity < max_model_len:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens but --max-model-len is {max_model_len}: one request "
            "could never fit; raise --kv-cache-bytes / --gpu-memory-utilization or lower --max-model-len"
        )
    if per_block:
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB)", num_blocks, block_size, capacity,
                    num_blocks * per_block / 2**30)
    if per_slot:
        logger.info("recurrent state: %d slots for requests and %d for prefix snapshots, %.2f MiB each (%.2f GiB)",
                    num_slots, num_snapshots, per_slot / 2**20, state_bytes / 2**30)
    return CachePlan(num_blocks, num_slots, block_size, per_block, per_slot, num_snapshots, state_slots_per_seq)


def allocate_caches(
    layers: Mapping[str, CacheLayer], num_blocks: int, num_state_slots: int, device: torch.device | str
) -> list[torch.Tensor]:
    """Give every cache layer its tensors: num_blocks paged blocks, num_state_slots state slots
    (counts that include any scratch block and slot). Returns the state tensors ([slots, ...] each)."""
    state_tensors: list[torch.Tensor] = []
    for layer in layers.values():
        spec = layer.cache_spec()
        if isinstance(spec, PagedCacheSpec):
            layer.bind_cache(spec.allocate(num_blocks, device))
        elif isinstance(spec, RecurrentStateSpec):
            tensors = spec.allocate(num_state_slots, device)
            layer.bind_cache(tensors)
            state_tensors.extend(tensors.values())
        else:
            raise ConfigError(f"no allocator for the cache spec {type(spec).__name__}")
    return state_tensors

"""CUDA graphs of the decode step, one per batch-size bucket, sharing one memory pool.

A decode step (every request adds exactly one token) has shapes that depend only on the batch
size, so it is captured once per bucket and replayed with the batch padded up to the bucket.
Padding rows write their KV into a scratch block that no request owns and attend to it alone.
Attention's launch plan (how many KV splits) depends on the longest context, so each batch
bucket is captured for a few context buckets too: a short context does not pay for the splits
and merge of the longest one.
"""

from __future__ import annotations

import bisect
import logging

import torch
from tqdm.auto import tqdm

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


CONTEXT_BUCKETS = (1024, 4096)


def context_buckets(max_model_len: int) -> list[int]:
    return [c for c in CONTEXT_BUCKETS if c < max_model_len] + [max_model_len]


def batch_size_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (vLLM's spacing), up to max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.buckets = batch_size_buckets(max_batch)
        self.contexts = context_buckets(max_model_len)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _metadata(self, batch: int, context: int) -> AttentionMetadata:
        # Host lengths are the bucket's largest, so any launch shape derived from them (e.g. the
        # number of KV splits) is valid for every replay in the bucket; kernels read the true
        # lengths on the device.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            query_lens_host=[1] * batch,
            seq_lens_host=[context] * batch,
        )

    def _forward(self, batch: int, context: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self._metadata(batch, context))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            shapes = [(b, c) for b in reversed(self.buckets) for c in reversed(self.contexts)]
            for shape in tqdm(shapes, desc="capturing CUDA graphs", leave=False):
                self._forward(*shape)  # warm-up: autotuning and lazy initialisation outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[shape] = self._forward(*shape)
                self.graphs[shape] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs for batch sizes up to %d", len(self.graphs), self.max_batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [B, V] of a decode batch of B <= max_batch requests."""
        batch = len(metadata.seq_lens_host)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        context = self.contexts[bisect.bisect_left(self.contexts, metadata.max_seq_len)]
        width = metadata.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(metadata.block_tables, non_blocking=True)
        if batch < bucket:
            self.slot_mapping[batch:bucket].fill_(self.scratch_slot)
            self.seq_lens[batch:bucket].fill_(1)
            self.block_tables[batch:bucket].fill_(self.scratch_block)
        self.graphs[bucket, context].replay()
        return self.logits[bucket, context][:batch]

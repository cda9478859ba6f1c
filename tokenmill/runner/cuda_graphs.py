"""CUDA graphs of uniform steps: every request adds exactly `query_len` tokens.

query_len 1 is a decode step; 1 + gamma is a speculative verify step (the last known token and
gamma drafts); 2 is a draft model's catch-up step. Such a step's shapes depend only on the
batch size, so it is captured once per batch bucket and replayed with the batch padded up to
the bucket. Padding requests write their KV into a scratch block that no request owns and
attend to it alone. Attention's launch plan (how many KV splits) depends on the longest
context, so each batch bucket is captured for a few context buckets too: a short context does
not pay for the splits and merge of the longest one.

Two context buckets of one batch bucket whose launch plans are equal (`CausalLM.graph_plan_key`:
at larger batches the attention kernels split no more at 128k than at 1k) share one graph, the
larger bucket's: only graphs that differ are captured. Capture is eager (every graph at
start-up) or lazy (each graph the first time a step needs it, its cost logged): see
EngineConfig.cuda_graph_capture.

A step whose requests add different numbers of tokens, every one sampled (drafts of different
lengths, a request whose max_tokens leaves room for fewer than gamma), replays the verify graph
too: `StepGraphs.pad` puts each request's missing rows in front of its real ones, where the
attention kernels place them at the positions just before (tokens already in the cache, read,
never written: their KV goes to the scratch block), so the real rows see exactly what they see
unpadded.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.step_context import RequestInputSpec, StepContext
from tokenmill.models.interface import CausalLM
from tokenmill.transfer import to_device

logger = logging.getLogger(__name__)

CONTEXT_BUCKETS = (256, 1024, 4096)
# Verify steps are captured up to this many tokens per step (vLLM's default capture limit).
MAX_CAPTURED_TOKENS = 512
# A padded step may cost this many tokens whatever its real count: a step of this few tokens
# costs about what a one-token step does, while an eager step pays the host's launches.
PADDING_FREE_TOKENS = 128


PlanKey = Callable[[AttentionMetadata], Hashable]
"""What a graph captured over a step's metadata depends on beyond its shapes (its host-side launch plans)."""

StepFunction = Callable[[torch.Tensor, StepContext], tuple[torch.Tensor, ...]]
"""(input ids, context) -> the captured outputs, logits first; each output has a row per token or
a row per request (`StepGraphs.run_outputs` slices either to the step's real rows)."""


@dataclass(frozen=True)
class TokenInputSpec:
    """A per-token input a step function reads from StepContext.token_inputs ([T, *shape]);
    padding rows of a CUDA graph hold zeros."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PaddedStep:
    input_ids: torch.Tensor
    ctx: StepContext  # every request adds query_len tokens
    real_rows: torch.Tensor  # the padded rows that are the step's own, in the unpadded order


def context_buckets(max_model_len: int) -> list[int]:
    return [c for c in CONTEXT_BUCKETS if c < max_model_len] + [max_model_len]


def batch_size_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (vLLM's spacing), up to max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return [s for s in sizes if s < max_batch] + [max_batch]


class StepGraphs:
    def __init__(
        self,
        model: CausalLM,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        query_len: int = 1,
        name: str = "decode",
        scratch_state_slot: int | None = None,
        request_inputs: dict[str, RequestInputSpec] | None = None,
        step_function: StepFunction | None = None,
        token_inputs: dict[str, TokenInputSpec] | None = None,
        keep_hidden: tuple[int, ...] = (),
        token_outputs: tuple[str, ...] = (),
        plan_key: PlanKey | None = None,
        lazy: bool = False,
    ) -> None:
        """scratch_state_slot: the recurrent-state slot padding requests use (None: the model keeps
        no state). request_inputs: the model's per-request inputs, each a static buffer whose
        padding rows hold the spec's pad value. step_function: what is captured (default: the
        model's logits of every row); token_inputs: its per-token inputs, static buffers too;
        keep_hidden: StepContext.keep_hidden of the captured forward (hidden states it records);
        token_outputs: the per-token outputs the forward records (StepContext.outputs), each graph
        keeping its own, handed to the caller's context on replay. plan_key: equal keys of two
        context buckets let them share a graph (None, or a step function of its own: every bucket
        has its own). lazy: capture() captures nothing; each graph is captured when run() needs it."""
        self.model = model
        self.step_function = step_function or self._logits_of_every_row
        self.keep_hidden = keep_hidden
        self.query_len = query_len
        self.name = name
        self.buckets = batch_size_buckets(max_batch)
        self.contexts = context_buckets(max_model_len)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = self.buckets[-1]
        tokens = n * query_len
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), self.scratch_slot, dtype=torch.int64, device=device)
        # A padding request's length is its query length: its causal rows stay inside the scratch block.
        self.seq_lens = torch.full((n,), query_len, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (n + 1) * query_len, query_len, dtype=torch.int32, device=device)
        self.token_rows = torch.arange(n, device=device).repeat_interleave(query_len)
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = None if scratch_state_slot is None else torch.full(
            (n,), scratch_state_slot, dtype=torch.int64, device=device)
        # Per token, a slot to also write the state after it into (verify steps, prefix snapshots); -1 none.
        self.state_checkpoints = None if scratch_state_slot is None else torch.full(
            (tokens,), -1, dtype=torch.int64, device=device)
        self.request_input_specs = dict(request_inputs or {})
        self.request_inputs = {
            name: torch.full((n, *spec.shape), spec.pad, dtype=spec.dtype, device=device)
            for name, spec in self.request_input_specs.items()
        }
        self.token_input_specs = dict(token_inputs or {})
        self.token_inputs = {name: torch.zeros((tokens, *spec.shape), dtype=spec.dtype, device=device)
                             for name, spec in self.token_input_specs.items()}
        self.token_outputs = token_outputs
        # Every (batch, context) bucket -> the one whose graph it replays (itself, or a larger context).
        self.shared = self._share_contexts(plan_key if step_function is None else None)
        self.lazy = lazy
        # Keyed by every bucket, a shared one aliasing its graph's entries once that is captured.
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.recorded: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.capture_seconds: dict[tuple[int, int], tuple[float, float]] = {}  # host (warm-up, capture) per graph
        self._pool: tuple[int, int] | None = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def distinct_shapes(self) -> list[tuple[int, int]]:
        """The graphs there are to capture, largest first."""
        return sorted(set(self.shared.values()), reverse=True)

    def _share_contexts(self, plan_key: PlanKey | None) -> dict[tuple[int, int], tuple[int, int]]:
        shared = {}
        for batch in self.buckets:
            seen: dict[Hashable, int] = {}
            for context in reversed(self.contexts):  # a larger context's graph serves a smaller one
                key = context if plan_key is None else plan_key(self.static_context(batch, context).attention)
                shared[batch, context] = batch, seen.setdefault(key, context)
        return shared

    def fits(self, num_requests: int, query_len: int) -> bool:
        """Whether a uniform step of num_requests requests adding query_len tokens each replays here."""
        return query_len == self.query_len and num_requests <= self.max_batch

    def fits_padded(self, metadata: AttentionMetadata) -> bool:
        """Whether a step of every-row-sampled requests adding different numbers of tokens replays
        here padded to query_len, at a padded size worth it."""
        padded = metadata.num_requests * self.query_len
        return (
            self.state_slots is None  # pad rows would run through a recurrent state
            and metadata.num_requests <= self.max_batch
            and max(metadata.query_lens_host) <= self.query_len <= min(metadata.seq_lens_host)
            and padded <= max(PADDING_FREE_TOKENS, 2 * sum(metadata.query_lens_host))
        )

    def static_context(self, batch: int, context: int) -> StepContext:
        """The context a graph of `batch` requests is captured over: views of the static buffers.
        Host lengths are the bucket's largest, so any launch shape derived from them (e.g. the
        number of KV splits) is valid for every replay in the bucket; kernels read the true
        lengths on the device."""
        tokens = batch * self.query_len
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:tokens],
            query_lens_host=[self.query_len] * batch,
            seq_lens_host=[context] * batch,
        )
        return StepContext(
            self.positions[:tokens], metadata,
            state_slots=None if self.state_slots is None else self.state_slots[:batch],
            state_checkpoints=None if self.state_checkpoints is None else self.state_checkpoints[:tokens],
            token_rows=self.token_rows[:tokens],
            request_inputs={name: buffer[:batch] for name, buffer in self.request_inputs.items()},
            token_inputs={name: buffer[:tokens] for name, buffer in self.token_inputs.items()},
            keep_hidden=self.keep_hidden,
        )

    def _logits_of_every_row(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        return (self.model.compute_logits(self.model(input_ids, ctx)),)

    def _forward(self, batch: int, context: int) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        tokens = batch * self.query_len
        ctx = self.static_context(batch, context)
        outputs = self.step_function(self.input_ids[:tokens], ctx)
        missing = [name for name in self.token_outputs if name not in ctx.outputs]
        if missing:
            raise RuntimeError(f"the {self.name} graph's forward recorded no {', '.join(missing)}")
        return outputs, {name: ctx.outputs[name] for name in self.token_outputs}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every distinct graph now (nothing when lazy)."""
        if self.lazy:
            logger.info("%s CUDA graphs: %d distinct of %d buckets, each captured the first time a step needs it",
                        self.name, len(self.distinct_shapes), len(self.shared))
            return
        start = time.perf_counter()
        self._capture(self.distinct_shapes, progress=True)
        warm = sum(w for w, _ in self.capture_seconds.values())
        logger.info("captured %d %s CUDA graphs (%d tokens per request, %d buckets) for batch sizes up to %d in %.1f s "
                    "(%.1f s launching warm-up forwards)", len(self.distinct_shapes), self.name, self.query_len,
                    len(self.shared), self.max_batch, time.perf_counter() - start, warm)

    def _capture(self, shapes: list[tuple[int, int]], progress: bool = False) -> None:
        """Warm up and capture each shape over padding-only static buffers (every row writes the
        scratch block and slot), then alias the buckets that share it."""
        self._pad_rows(0)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for shape in tqdm(shapes, desc=f"capturing {self.name} CUDA graphs", leave=False, disable=not progress):
                start = time.perf_counter()
                self._forward(*shape)  # warm-up: autotuning and lazy initialisation outside capture
                warm = time.perf_counter()  # host time: the warm-up's launches (and any compilation)
                graph = torch.cuda.CUDAGraph()
                # capture_begin / capture_end directly: torch.cuda.graph would also empty the
                # allocator's cache before every capture, and the next warm-up allocate it again.
                graph.capture_begin(self._pool, capture_error_mode="thread_local")
                try:
                    self.outputs[shape], self.recorded[shape] = self._forward(*shape)
                finally:
                    graph.capture_end()
                self.graphs[shape] = graph
                self.capture_seconds[shape] = (warm - start, time.perf_counter() - warm)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bucket, graph_shape in self.shared.items():
            if graph_shape in self.graphs:
                self.graphs[bucket] = self.graphs[graph_shape]
                self.outputs[bucket], self.recorded[bucket] = self.outputs[graph_shape], self.recorded[graph_shape]

    def run(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Logits [B * query_len, V] of B <= max_batch requests adding query_len tokens each."""
        return self.run_outputs(input_ids, ctx)[0]

    def run_outputs(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """Every output of the step function, sliced to the step's B requests (views of static
        buffers: valid until the next replay of these graphs)."""
        shape = self.shared[self.bucket(ctx.attention)]
        if shape not in self.graphs:
            start = time.perf_counter()
            self._capture([shape])
            logger.info("captured the %s CUDA graph of batch <= %d, context <= %d on first use in %.2f s (%d of %d)",
                        self.name, *shape, time.perf_counter() - start, len(self.capture_seconds),
                        len(self.distinct_shapes))
        self.stage(input_ids, ctx)
        self.graphs[shape].replay()
        bucket = shape[0]
        batch = ctx.attention.num_requests
        tokens = batch * self.query_len
        ctx.outputs.update({name: out[:tokens] for name, out in self.recorded[shape].items()})
        return tuple(out[: batch * (out.shape[0] // bucket)] for out in self.outputs[shape])

    def bucket(self, metadata: AttentionMetadata) -> tuple[int, int]:
        """The (batch, context) bucket of a uniform step."""
        return (self.buckets[bisect.bisect_left(self.buckets, metadata.num_requests)],
                self.contexts[bisect.bisect_left(self.contexts, metadata.max_seq_len)])

    def stage(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[int, int]:
        """Copy a uniform step into the static buffers, padding requests up to the batch bucket
        (scratch block, scratch state slot, pad values); returns the (bucket, context) to replay."""
        metadata = ctx.attention
        batch = metadata.num_requests
        tokens = batch * self.query_len
        bucket, context = self.bucket(metadata)
        width = metadata.block_tables.shape[1]
        self.input_ids[:tokens].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(ctx.positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(metadata.block_tables, non_blocking=True)
        if self.state_slots is not None:
            if ctx.state_slots is None:
                raise ValueError(f"the {self.name} graphs were captured with state slots but the step has none")
            self.state_slots[:batch].copy_(ctx.state_slots, non_blocking=True)
        if self.state_checkpoints is not None:
            if ctx.state_checkpoints is not None:
                self.state_checkpoints[:tokens].copy_(ctx.state_checkpoints, non_blocking=True)
            else:
                self.state_checkpoints[:tokens].fill_(-1)
        for name, buffer in self.request_inputs.items():
            buffer[:batch].copy_(ctx.request_inputs[name], non_blocking=True)
        for name, buffer in self.token_inputs.items():
            buffer[:tokens].copy_(ctx.token_inputs[name], non_blocking=True)
        if batch < bucket:
            self._pad_rows(batch, bucket)
        return bucket, context

    def _pad_rows(self, first: int, end: int | None = None) -> None:
        """Make requests first..end (None: every one) padding: scratch block and slot, pad values."""
        end = self.max_batch if end is None else end
        q = self.query_len
        self.slot_mapping[first * q : end * q].fill_(self.scratch_slot)
        self.seq_lens[first:end].fill_(q)
        self.block_tables[first:end].fill_(self.scratch_block)
        if self.state_slots is not None:
            self.state_slots[first:end].fill_(self.scratch_state_slot)
        if self.state_checkpoints is not None:
            self.state_checkpoints[first * q : end * q].fill_(-1)
        for name, buffer in self.request_inputs.items():
            buffer[first:end].fill_(self.request_input_specs[name].pad)
        for buffer in self.token_inputs.values():
            buffer[first * q : end * q].zero_()

    def run_padded(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Logits of the rows of a step that `fits_padded`, in its order."""
        return self.run_padded_outputs(input_ids, ctx)[0]

    def run_padded_outputs(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """The per-token outputs of the step function at the rows of a step that `fits_padded`."""
        step = self.pad(input_ids, ctx)
        outputs = tuple(out[step.real_rows] for out in self.run_outputs(step.input_ids, step.ctx))
        ctx.outputs.update({name: out[step.real_rows] for name, out in step.ctx.outputs.items()})
        return outputs

    def pad(self, input_ids: torch.Tensor, ctx: StepContext) -> PaddedStep:
        """The step with each request's rows padded at the front to query_len. Request b's pad rows
        sit at positions seq_len_b - query_len .. (needs seq_len_b >= query_len) and write their KV
        into the scratch slot; their logits are not in real_rows."""
        q = self.query_len
        metadata = ctx.attention
        source: list[int] = []  # per padded row, its row in the unpadded step; -1 for padding
        positions: list[int] = []
        real_rows: list[int] = []
        start = 0
        for b, (rows, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
            pad = q - rows
            if pad < 0 or seq_len < q:
                raise ValueError(f"request {b} cannot be padded to {q} rows ({rows} rows, {seq_len} tokens)")
            source += [-1] * pad + list(range(start, start + rows))
            positions += range(seq_len - q, seq_len)
            real_rows += range(b * q + pad, (b + 1) * q)
            start += rows
        padded = len(source)
        uploaded = to_device(source + positions + real_rows, torch.int64, input_ids.device)
        source_rows = uploaded[:padded]
        is_real = source_rows >= 0
        source_rows = source_rows.clamp(min=0)
        batch = metadata.num_requests
        padded_metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            slot_mapping=torch.where(is_real, metadata.slot_mapping[source_rows], self.scratch_slot),
            query_lens_host=[q] * batch,
            seq_lens_host=metadata.seq_lens_host,
        )
        return PaddedStep(
            input_ids=torch.where(is_real, input_ids[source_rows], 0),
            ctx=StepContext(uploaded[padded : 2 * padded], padded_metadata, state_slots=ctx.state_slots,
                            token_rows=self.token_rows[:padded], request_inputs=ctx.request_inputs),
            real_rows=uploaded[2 * padded :],
        )


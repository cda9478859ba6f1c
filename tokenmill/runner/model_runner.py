"""The model runner: owns the model and the KV tensors; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.kv.planner import allocate_caches, plan_caches
from tokenmill.kv.specs import CacheLayer, PagedCacheSpec, RecurrentStateSpec
from tokenmill.kv.state import NO_CHECKPOINT
from tokenmill.layers.attention import ATTENTION_BACKENDS, AttentionMetadata
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM, ModelBuild, StepModel
from tokenmill.models.loader import CheckpointSource
from tokenmill.models.steering_file import SteeringFile, check_model, load_steering_file, model_identity, steering_module
from tokenmill.models.step_cost import memory_grows_with_depth
from tokenmill.numerics import KV_CACHE_DTYPES, recurrent_state_dtype
from tokenmill.runner.batch import Chunk, pack
from tokenmill.runner.cuda_graphs import MAX_CAPTURED_TOKENS, StepFunction, StepGraphs, TokenInputSpec
from tokenmill.runner.kv_calibration import configure_kv_scales
from tokenmill.runner.memory import check_weights_fit, kv_cache_budget
from tokenmill.runner.model_builder import (
    build_model,
    checkpoint_quantization,
    engine_choices,
    model_weight_bytes,
    with_dual_weights,
)
from tokenmill.runner.step_input import StepInput
from tokenmill.sample import draft_verification
from tokenmill.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from tokenmill.sampling_params import SamplingParams
from tokenmill.transfer import to_device

# The costliest sampling path, for the memory profile.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20)


@dataclass
class StepOutput:
    """The sampled tokens of one launched step. On CUDA their host copy runs on a side stream;
    reading them waits for that copy only, never for the whole device."""

    sampled: SamplerOutput  # device tensors (the next step may read token ids from here)
    host_token_ids: torch.Tensor  # [B], or [B, G + 1] after verifying drafts
    host_logprob_ids: torch.Tensor | None  # [B, 1 + k], or [B, G + 1, 1 + k]
    host_logprobs: torch.Tensor | None
    copied: torch.cuda.Event | None
    host_num_accepted: torch.Tensor | None = None  # [B] drafts accepted; None without drafts
    host_outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's token outputs, [B] each

    def token_lists(self) -> list[list[int]]:
        ids = self.host_token_ids.tolist()
        if self.host_num_accepted is None:
            return [[t] for t in ids]
        return [row[: tau + 1] for row, tau in zip(ids, self.host_num_accepted.tolist())]

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


@dataclass
class StepHidden:
    """What a proposer head built on the target (an MTP head, a block drafter) reads of the step
    last launched: the target's hidden states for it (the head's `HiddenTap`) at every row, the
    ids the forward read (drafts and placeholders filled in) and the forward's context. Under
    CUDA graphs the hidden states are a static buffer's view: valid until the target's next step."""

    hidden: torch.Tensor  # [T, width]
    input_ids: torch.Tensor  # [T]
    ctx: StepContext
    uniform_query_len: int | None  # as BatchInputs says


@dataclass(frozen=True)
class HiddenTap:
    """What a head reads of every target forward: the StepContext.keep_hidden entries the forward
    records (`CausalLM.mtp_keep_hidden`, or the layers a block drafter taps) and the [T, width]
    tensor made of the final hidden states and those (`CausalLM.mtp_tap`, `CausalLM.layer_outputs`).
    The target's CUDA graphs output it beside the logits."""

    keep_hidden: tuple[int, ...]
    read: Callable[[torch.Tensor, StepContext], torch.Tensor]


@dataclass
class HeadParts:
    cache_layers: dict[str, CacheLayer]  # sized and allocated with the target's (they share its block ids)
    tap: HiddenTap


HeadBuilder = Callable[[CausalLM, ModelBuild], HeadParts]
"""(the built target, its build) -> a proposer head on the target (an MTP head from its own
checkpoint, a block drafter fed its hidden states): its cache layers and what it reads."""


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    ctx: StepContext
    logits_indices: torch.Tensor  # rows of the packed batch whose next token is sampled
    # Tokens every request adds when all add the same number and every row is sampled (a decode
    # or verify step: what CUDA graphs capture); None otherwise.
    uniform_query_len: int | None


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: PretrainedConfig, source: CheckpointSource,
        companion_cache_layers: dict[str, CacheLayer] | None = None, head: HeadBuilder | None = None,
        steering: SteeringFile | None = None,
    ) -> None:
        """companion_cache_layers: a draft model's cache layers, sized and allocated with the
        target's (they share its block ids). head: builds a proposer head on the target before its
        caches are sized; with one, every step keeps the hidden states it reads (`last_hidden`).
        steering: a steering file to install (else the one --steering names, if any)."""
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_CACHE_DTYPES.get(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.vocab_size = hf_config.vocab_size
        self.backend = ATTENTION_BACKENDS[config.cache.attention_backend]()
        self.use_triton = self.device.type == "cuda"  # the fused Triton kernels; import fails closed below
        if self.use_triton:
            _require_triton()
        state_dtype = recurrent_state_dtype(config.cache.mamba_ssm_cache_dtype, getattr(hf_config, "mamba_ssm_dtype", None))
        dummy = config.model.load_format == "dummy"
        quantization = checkpoint_quantization(hf_config, source, self.use_triton, read_weights=not dummy,
                                               choices=engine_choices(config, self.device))
        quantization = with_dual_weights(quantization, config, self.use_triton)
        self.build = ModelBuild(hf_config, self.backend, config.model.max_model_len, self.block_size, self.kv_dtype,
                                self.use_triton, quantization, state_dtype=state_dtype)
        check_weights_fit(lambda: model_weight_bytes(self.build, self.dtype), config, self.device,
                          kv_cache_bytes=config.cache.kv_cache_bytes)
        self.model = build_model(self.build, source, dtype=self.dtype, device=self.device,
                                 dummy_seed=config.model.seed if dummy else None)
        self.model_name = config.model.model or source.name
        self.steering: SteeringFile | None = None
        self.graphs: list[StepGraphs] = []
        path = config.steering.steering
        if steering is not None or path:
            self.install_steering(steering or load_steering_file(path))
        self.request_input_specs = self.model.request_inputs()
        self.token_output_names = self.model.token_outputs()
        self.tap: HiddenTap | None = None
        if head is not None:
            parts = head(self.model, self.build)
            companion_cache_layers = {**(companion_cache_layers or {}), **parts.cache_layers}
            self.tap = parts.tap
        self.keeps_hidden = self.tap is not None
        self.last_hidden: StepHidden | None = None
        self.cache_layers = {**self.model.cache_layers(), **(companion_cache_layers or {})}
        self.sampler = Sampler()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        speculative = config.speculative
        self.spec_verification = speculative.verification
        self.accept_all_drafts = config.benchmark_only.accept_all_drafts
        weight_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        budget = kv_cache_budget(config, self.device, self._profile_step, weight_bytes)
        specs = {name: layer.cache_spec() for name, layer in self.cache_layers.items()}
        spares = speculative.num_speculative_tokens if speculative.method is not None else 0
        snapshot_bytes = config.cache.mamba_snapshot_bytes if config.cache.enable_prefix_caching else 0
        self.cache_plan = plan_caches(specs, budget, self.block_size, config.model.max_model_len,
                                      config.scheduler.max_num_seqs, 1 + spares, snapshot_bytes)
        self.num_blocks = self.cache_plan.num_blocks
        # One block and one state slot beyond the pool: the scratch that padded CUDA-graph rows write into.
        self.state_tensors = allocate_caches(self.cache_layers, self.num_blocks + 1, self.cache_plan.scratch_slot + 1,
                                             self.device)
        configure_kv_scales(self, source)
        if not config.enforce_eager:
            max_batch = min(config.scheduler.max_num_seqs, MAX_CAPTURED_TOKENS)
            self.graphs.append(self.step_graphs(self.model, max_batch))
            if speculative.method is not None:
                verify_len = 1 + speculative.num_speculative_tokens
                self.graphs.append(self.step_graphs(
                    self.model, min(max_batch, MAX_CAPTURED_TOKENS // verify_len), verify_len, "verify"))
            for graphs in self.graphs:
                graphs.capture()

    def install_steering(self, file: SteeringFile) -> None:
        """Steer the model along `file`'s direction (checked against this model). Done at start-up,
        before the memory profile and the CUDA graphs, which then capture the steered forward; later
        (`tokenmill steer build`) only on an eager runner."""
        if self.graphs:
            raise ConfigError("steering must be installed before CUDA graphs are captured")
        check_model(file, model_identity(self.model, self.hf_config, self.model_name))
        self.model.set_residual_steering(steering_module(file, self.hf_config.num_hidden_layers, self.use_triton,
                                                         self.device))
        self.steering = file
        self.request_input_specs = self.model.request_inputs()
        self.token_output_names = self.model.token_outputs()

    def step_graphs(self, model: StepModel, max_batch: int, query_len: int = 1, name: str = "decode",
                    step_function: StepFunction | None = None,
                    token_inputs: dict[str, TokenInputSpec] | None = None) -> StepGraphs:
        """Graphs of `model` (the target, or a draft or head sharing its block tables) over this
        runner's cache layout; the target's keep the MTP tap beside the logits when a head reads it."""
        plan = self.cache_plan
        has_state = any(isinstance(spec, RecurrentStateSpec) for spec in model.cache_specs().values())
        keep_hidden: tuple[int, ...] = ()
        if model is self.model and self.tap is not None:
            step_function, keep_hidden = self._logits_and_tap, self.tap.keep_hidden
        return StepGraphs(model, max_batch, self.max_blocks_per_seq, self.num_blocks, self.block_size,
                          self.config.model.max_model_len, self.device, query_len, name,
                          scratch_state_slot=plan.scratch_slot if has_state and plan.bytes_per_state_slot else None,
                          request_inputs=model.request_inputs(), step_function=step_function,
                          token_inputs=token_inputs, keep_hidden=keep_hidden, token_outputs=model.token_outputs(),
                          plan_key=getattr(model, "graph_plan_key", None),
                          lazy=self.config.cuda_graph_capture == "lazy")

    def _logits_and_tap(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        assert self.tap is not None
        hidden = self.model(input_ids, ctx)
        return self.model.compute_logits(hidden), self.tap.read(hidden, ctx)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.config.model.max_model_len // self.block_size)

    @torch.inference_mode()
    def _profile_step(self) -> int:
        """The largest step the scheduler may send: a full token budget (the larger of the decode and
        long-prefill ones), logits for every sequence; its keys at the deepest context where the
        model's step memory grows with depth. Returns the bytes of the scratch caches it ran over
        (not activations: the KV budget is computed without them)."""
        sched = self.config.scheduler
        max_len = self.config.model.max_model_len
        tokens = min(max(sched.max_num_batched_tokens, sched.long_prefill_batched_tokens or 0), max_len)
        context = max_len if memory_grows_with_depth(self.model) else tokens
        blocks = -(-context // self.block_size)
        target_layers = self.model.cache_layers()
        scratch = sum(t.numel() * t.element_size() for t in allocate_caches(target_layers, blocks, 1, self.device))
        scratch += sum(layer.cache_spec().bytes_per_block() * blocks for layer in target_layers.values()
                       if isinstance(layer.cache_spec(), PagedCacheSpec))
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([context], dtype=torch.int32, device=self.device),
            block_tables=table,
            slot_mapping=torch.arange(context - tokens, context, device=self.device),
            query_lens_host=[tokens],
            seq_lens_host=[context],
        )
        ctx = StepContext(torch.arange(context - tokens, context, device=self.device), metadata,
                          state_slots=torch.zeros(1, dtype=torch.int64, device=self.device),
                          keep_hidden=self.tap.keep_hidden if self.tap is not None else ())
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), ctx)
        tap = self.tap.read(hidden, ctx) if self.tap is not None else None  # kept, as a step keeps it
        rows = min(self.config.scheduler.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:rows])
        self.sampler(logits, SamplingMetadata.build(
            [SamplingRow(_PROFILE_PARAMS, [0], [], None)] * rows, self.vocab_size, self.device))
        del tap
        allocate_caches(target_layers, 0, 0, self.device)
        return scratch

    def prepare_inputs(self, step: StepInput, previous: StepOutput | None = None) -> BatchInputs:
        """The step's batch tensors; resuming requests' states are copied into their slots first."""
        if step.state_copies:
            self.copy_state_slots(step.state_copies)
        chunks: list[Chunk] = []
        # Tokens sampled by the step still in flight: (row in this batch, row in that step).
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        # Drafts known only on the device: (first row in this batch, their ids).
        device_drafts: list[tuple[int, torch.Tensor]] = []
        logits_indices: list[int] = []
        state_slots: list[int] = []
        checkpoints = [] if any(r.checkpoint_slots is not None for r in step.requests) else None
        row = 0
        for request in step.requests:
            tokens = list(request.token_ids)
            if request.device_drafts is not None:
                device_drafts.append((row + len(tokens), request.device_drafts))
                tokens += [0] * request.device_drafts.numel()
            if request.placeholder_row is not None:  # the last token is read on the device
                placeholder_rows.append(row + request.num_rows - 1)
                previous_rows.append(request.placeholder_row)
                tokens.append(0)
            chunks.append(Chunk(tokens, request.start, request.block_ids))
            if request.state_slot is not None:
                state_slots.append(request.state_slot)
            if checkpoints is not None:
                checkpoints.extend(request.checkpoint_slots or [NO_CHECKPOINT] * request.num_rows)
            row += request.num_rows
            logits_indices.extend(range(row - request.num_sampled_rows, row))
        ids, positions, metadata = pack(chunks, self.block_size, self.device)
        if device_drafts:
            rows = [first + i for first, draft_ids in device_drafts for i in range(draft_ids.numel())]
            ids[to_device(rows, torch.int64, self.device)] = torch.cat([draft_ids for _, draft_ids in device_drafts])
        if placeholder_rows:
            assert previous is not None
            sampled = previous.sampled.sampled_token_ids
            if placeholder_rows == previous_rows == list(range(row)) and sampled.shape == (row,):
                ids = sampled  # steady decode: this step's inputs are the last step's samples, in order
            else:
                ids[to_device(placeholder_rows, torch.int64, self.device)] = sampled[
                    to_device(previous_rows, torch.int64, self.device)]
        if state_slots and len(state_slots) != len(step.requests):
            raise ValueError("every request of a model with recurrent state needs a state slot")
        ctx = StepContext(positions, metadata,
                          state_slots=to_device(state_slots, torch.int64, self.device) if state_slots else None,
                          state_checkpoints=None if checkpoints is None else to_device(checkpoints, torch.int64, self.device))
        if self.request_input_specs:
            self._add_request_inputs(ctx, step)
        return BatchInputs(
            input_ids=ids,
            ctx=ctx,
            logits_indices=to_device(logits_indices, torch.int64, self.device),
            uniform_query_len=_uniform_query_len(metadata.query_lens_host, len(logits_indices)),
        )

    def _add_request_inputs(self, ctx: StepContext, step: StepInput) -> None:
        """The model's per-request inputs (one value per request; a request without one gets the
        spec's pad value) and the request row of every token."""
        for name, spec in self.request_input_specs.items():
            if spec.shape:
                raise ValueError(f"request input {name!r} has shape {spec.shape}; the runner fills scalar inputs only")
            values = [r.inputs.get(name, spec.pad) for r in step.requests]
            ctx.request_inputs[name] = to_device(values, spec.dtype, self.device)
        rows = [i for i, r in enumerate(step.requests) for _ in range(r.num_rows)]
        ctx.token_rows = to_device(rows, torch.int64, self.device)

    @torch.inference_mode()
    def execute(self, step: StepInput, previous: StepOutput | None = None) -> StepOutput | None:
        """Launch one step; sample a token for every request with sampled rows (with drafts: verify
        them and sample the correction or bonus token). `previous` is the step still in flight,
        whose sampled ids feed this step's placeholders."""
        inputs = self.prepare_inputs(step, previous)
        logits = self._logits(inputs)
        if logits is None:
            return None
        outputs = {name: inputs.ctx.outputs[name][inputs.logits_indices] for name in self.token_output_names}
        for row, mask in enumerate(step.allowed_masks):
            if mask is not None:
                logits[row].masked_fill_(~mask.to(self.device, non_blocking=True), float("-inf"))
        if step.drafts is not None:
            spec = draft_verification.verify_drafts(logits, step.drafts, self.vocab_size, self.spec_verification,
                                                    self.accept_all_drafts)
            sampled = SamplerOutput(spec.token_ids, spec.logprob_token_ids, spec.logprobs)
            return self._copy_to_host(sampled, spec.num_accepted, outputs)
        sampled = self.sampler(logits, SamplingMetadata.build(step.sampling, self.vocab_size, self.device))
        return self._copy_to_host(sampled, None, outputs)

    def _copy_to_host(self, sampled: SamplerOutput, num_accepted: torch.Tensor | None = None,
                      outputs: dict[str, torch.Tensor] | None = None) -> StepOutput:
        names = list(outputs or {})
        tensors = [sampled.sampled_token_ids, sampled.logprob_token_ids, sampled.logprobs, num_accepted,
                   *(outputs or {}).values()]
        if self.copy_stream is None:
            return StepOutput(sampled, *tensors[:3], copied=None, host_num_accepted=num_accepted,
                              host_outputs=dict(zip(names, tensors[4:])))
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        host: list[torch.Tensor | None] = []
        with torch.cuda.stream(self.copy_stream):
            for tensor in tensors:
                if tensor is None:
                    host.append(None)
                    continue
                tensor.record_stream(self.copy_stream)
                host.append(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        return StepOutput(sampled, host[0], host[1], host[2], copied, host[3],
                          host_outputs=dict(zip(names, host[4:])))  # type: ignore[arg-type]

    def _logits(self, inputs: BatchInputs) -> torch.Tensor | None:
        """The sampled rows' logits (None when no row is sampled); keeps `last_hidden` when a head reads it."""
        logits, tap = self._forward(inputs)
        if self.keeps_hidden:
            assert tap is not None
            self.last_hidden = StepHidden(tap, inputs.input_ids, inputs.ctx, inputs.uniform_query_len)
        return logits

    def _forward(self, inputs: BatchInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ctx, tapped = inputs.ctx, self.keeps_hidden
        if inputs.uniform_query_len is not None:
            for graphs in self.graphs:
                if graphs.fits(ctx.attention.num_requests, inputs.uniform_query_len):
                    if not tapped:
                        return graphs.run(inputs.input_ids, ctx), None
                    logits, tap = graphs.run_outputs(inputs.input_ids, ctx)
                    return logits, tap
        if 0 < inputs.logits_indices.numel() == inputs.input_ids.numel():  # every row sampled: decode and verify
            for graphs in self.graphs:
                if graphs.fits_padded(ctx.attention):
                    if not tapped:
                        return graphs.run_padded(inputs.input_ids, ctx), None
                    logits, tap = graphs.run_padded_outputs(inputs.input_ids, ctx)
                    return logits, tap
        if self.tap is not None:
            ctx.keep_hidden = self.tap.keep_hidden
        hidden = self.model(inputs.input_ids, ctx)
        tap = self.tap.read(hidden, ctx) if self.tap is not None else None
        if inputs.logits_indices.numel() == 0:
            return None, tap
        return self.model.compute_logits(hidden[inputs.logits_indices]), tap

    def copy_state_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole recurrent states between slots (every state tensor of every layer): a request
        resuming from a prefix snapshot."""
        pairs = to_device([i for pair in copies for i in pair], torch.int64, self.device).view(-1, 2)
        for tensor in self.state_tensors:
            tensor[pairs[:, 1]] = tensor[pairs[:, 0]]

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def _uniform_query_len(query_lens: list[int], num_sampled_rows: int) -> int | None:
    """The tokens each request adds when all add as many and every row is sampled, else None."""
    first = query_lens[0]
    if num_sampled_rows == first * len(query_lens) and all(n == first for n in query_lens):
        return first
    return None


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"CUDA runs need triton for the fused kernels ({exc}); pip install triton") from exc

"""The model runner: owns the model and the KV tensors; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledBatch
from tokenmill.errors import ConfigError
from tokenmill.layers.attention import ATTENTION_BACKENDS, AttentionMetadata
from tokenmill.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from tokenmill.models.llama import LlamaForCausalLM, head_dim_of
from tokenmill.models.loader import CheckpointSource, iter_weights
from tokenmill.models.registry import model_class
from tokenmill.runner.batch import Chunk, pack, to_device
from tokenmill.runner.cuda_graphs import MAX_CAPTURED_TOKENS, StepGraphs
from tokenmill.runner.kv_scales import configure_kv_scales
from tokenmill.runner.memory import kv_cache_budget, plan_num_blocks
from tokenmill.sampling_params import SamplingParams

KV_DTYPES = {"fp8": torch.float8_e4m3fn}
# The costliest sampling path, for the memory profile.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20)


@dataclass
class StepOutput:
    """The sampled tokens of one launched step. On CUDA their host copy runs on a side stream;
    reading them waits for that copy only, never for the whole device."""

    requests: list[Request]  # one per sampled row
    sampled: SamplerOutput  # device tensors (the next step may read token ids from here)
    host_token_ids: torch.Tensor  # [B], or [B, G + 1] after verifying drafts
    host_logprob_ids: torch.Tensor | None  # [B, 1 + k], or [B, G + 1, 1 + k]
    host_logprobs: torch.Tensor | None
    copied: torch.cuda.Event | None
    host_num_accepted: torch.Tensor | None = None  # [B] drafts accepted; None without drafts

    def token_lists(self) -> list[list[int]]:
        ids = self.host_token_ids.tolist()
        if self.host_num_accepted is None:
            return [[t] for t in ids]
        return [row[: tau + 1] for row, tau in zip(ids, self.host_num_accepted.tolist())]

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the packed batch whose next token is sampled
    # Tokens every request adds when all add the same number and every row is sampled (a decode
    # or verify step: what CUDA graphs capture); None otherwise.
    uniform_query_len: int | None


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: PretrainedConfig, source: CheckpointSource, extra_kv_bytes_per_block: int = 0
    ) -> None:
        """extra_kv_bytes_per_block: what a draft model's cache adds to each block (it shares the block ids)."""
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_DTYPES.get(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.vocab_size = hf_config.vocab_size
        self.backend = ATTENTION_BACKENDS[config.cache.attention_backend]()
        self.backend.check_supported(
            hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim_of(hf_config), self.dtype, self.kv_dtype
        )
        self.use_triton = self.device.type == "cuda"  # fused small ops; import fails closed below
        if self.use_triton:
            _require_triton()
        self.model = self._load_model(source)
        self.sampler = Sampler()
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        speculative = config.speculative
        self.spec_verification = speculative.verification if speculative.method is not None else None
        self.spec_benchmark_length = speculative.benchmark_acceptance_length
        budget = kv_cache_budget(config, self.device, self._profile_step)
        self.num_blocks = plan_num_blocks(
            budget, self.kv_bytes_per_block() + extra_kv_bytes_per_block, self.block_size, config.model.max_model_len
        )
        # One block beyond the pool: the scratch block that padded CUDA-graph rows write into.
        self._allocate_kv_caches(self.num_blocks + 1)
        configure_kv_scales(self, source)
        self.graphs: list[StepGraphs] = []
        if not config.enforce_eager:
            max_batch = min(config.scheduler.max_num_seqs, MAX_CAPTURED_TOKENS)
            self.graphs.append(self.step_graphs(self.model, max_batch))
            if speculative.method is not None:
                verify_len = 1 + speculative.num_speculative_tokens
                self.graphs.append(self.step_graphs(
                    self.model, min(max_batch, MAX_CAPTURED_TOKENS // verify_len), verify_len, "verify"))
            for graphs in self.graphs:
                graphs.capture()

    def step_graphs(self, model: LlamaForCausalLM, max_batch: int, query_len: int = 1, name: str = "decode") -> StepGraphs:
        """Graphs of `model` (the target, or a draft sharing its block tables) over this runner's cache layout."""
        return StepGraphs(model, max_batch, self.max_blocks_per_seq, self.num_blocks, self.block_size,
                          self.config.model.max_model_len, self.device, query_len, name)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.config.model.max_model_len // self.block_size)

    def _load_model(self, source: CheckpointSource) -> LlamaForCausalLM:
        cls = model_class(self.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.hf_config, self.backend, self.config.model.max_model_len, self.use_triton)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.model.load_format == "dummy":
            init_dummy_weights(model, self.config.model.seed)
        else:
            model.load_weights(iter_weights(source))
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        c = self.hf_config
        per_token = 2 * c.num_key_value_heads * head_dim_of(c) * self.kv_dtype.itemsize
        return per_token * c.num_hidden_layers * self.block_size

    def _allocate_kv_caches(self, num_blocks: int) -> None:
        c = self.hf_config
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, c.num_key_value_heads, head_dim_of(c))
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """The largest step the scheduler may send: a full token budget, logits for every sequence."""
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        blocks = -(-tokens // self.block_size)
        self._allocate_kv_caches(blocks)
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            block_tables=table,
            slot_mapping=torch.arange(tokens, device=self.device),
            query_lens_host=[tokens],
            seq_lens_host=[tokens],
        )
        positions = torch.arange(tokens, device=self.device)
        hidden = self.model(torch.zeros(tokens, dtype=torch.int64, device=self.device), positions, metadata)
        rows = min(self.config.scheduler.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:rows])
        self.sampler(logits, SamplingMetadata.build(
            [SamplingRow(_PROFILE_PARAMS, [0], [], None)] * rows, self.vocab_size, self.device))
        self._allocate_kv_caches(0)

    def prepare_inputs(
        self, batch: ScheduledBatch, block_tables: Sequence[Sequence[int]], previous: StepOutput | None = None
    ) -> BatchInputs:
        chunks: list[Chunk] = []
        # Tokens sampled by the step still in flight: (row in this batch, row in that step).
        placeholder_rows: list[int] = []
        previous_rows: list[int] = []
        previous_index = {id(r): i for i, r in enumerate(previous.requests)} if previous else {}
        # Drafts known only on the device: (first row in this batch, their ids).
        device_drafts: list[tuple[int, torch.Tensor]] = []
        logits_indices: list[int] = []
        row = 0
        for request, n, table in zip(batch.requests, batch.num_new_tokens, block_tables):
            start = request.num_computed_tokens
            tokens = request.all_token_ids[start : start + n]
            drafts = request.drafts
            if len(tokens) < n and drafts.count:
                offset = max(0, start - len(request.all_token_ids))
                wanted = min(drafts.count - offset, n - len(tokens))
                if drafts.host_ids is not None:
                    tokens += drafts.host_ids[offset : offset + wanted]
                else:
                    assert drafts.device_ids is not None
                    device_drafts.append((row + len(tokens), drafts.device_ids[offset : offset + wanted]))
                    tokens += [0] * wanted
            if len(tokens) < n:  # the last token is a placeholder: read it on the device
                assert len(tokens) == n - 1, "at most one token per request is in flight"
                placeholder_rows.append(row + n - 1)
                previous_rows.append(previous_index[id(request)])
                tokens.append(0)
            chunks.append(Chunk(tokens, start, table))
            row += n
            if start + n == request.num_tokens_with_drafts:
                logits_indices.extend(range(row - drafts.count - 1, row))
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
        return BatchInputs(
            input_ids=ids,
            positions=positions,
            metadata=metadata,
            logits_indices=to_device(logits_indices, torch.int64, self.device),
            uniform_query_len=_uniform_query_len(metadata.query_lens_host, len(logits_indices)),
        )

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        block_tables: Sequence[Sequence[int]],
        sampling_requests: list[Request],
        allowed_masks: Sequence[torch.Tensor | None] = (),
        previous: StepOutput | None = None,
    ) -> StepOutput | None:
        """Launch one step; sample for `sampling_requests` (whose last token this step computes).

        `previous` is the step still in flight, whose sampled ids feed this step's placeholders.
        """
        inputs = self.prepare_inputs(batch, block_tables, previous)
        logits = self._logits(inputs)
        if logits is None:
            return None
        for row, mask in enumerate(allowed_masks):
            if mask is not None:
                logits[row].masked_fill_(~mask.to(self.device, non_blocking=True), float("-inf"))
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                # A grammar decides when the answer may end; min_tokens must not forbid its stop.
                banned_token_ids=[] if r.grammar is not None else r.banned_token_ids(),
            )
            for r in sampling_requests
        ]
        if self.spec_verification is not None:
            from tokenmill.speculative.target_step import verify_drafts

            spec = verify_drafts(logits, sampling_requests, self.vocab_size, self.spec_verification,
                                 self.spec_benchmark_length)
            sampled = SamplerOutput(spec.token_ids, spec.logprob_token_ids, spec.logprobs)
            return self._copy_to_host(sampling_requests, sampled, spec.num_accepted)
        sampled = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))
        return self._copy_to_host(sampling_requests, sampled)

    def _copy_to_host(
        self, requests: list[Request], sampled: SamplerOutput, num_accepted: torch.Tensor | None = None
    ) -> StepOutput:
        tensors = [sampled.sampled_token_ids, sampled.logprob_token_ids, sampled.logprobs, num_accepted]
        if self.copy_stream is None:
            return StepOutput(requests, sampled, *tensors[:3], copied=None, host_num_accepted=num_accepted)
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
        return StepOutput(requests, sampled, host[0], host[1], host[2], copied, host[3])

    def _logits(self, inputs: BatchInputs) -> torch.Tensor | None:
        if inputs.logits_indices.numel() == 0:
            self.model(inputs.input_ids, inputs.positions, inputs.metadata)
            return None
        if inputs.uniform_query_len is not None:
            for graphs in self.graphs:
                if graphs.fits(inputs.metadata.num_requests, inputs.uniform_query_len):
                    return graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        if inputs.logits_indices.numel() == inputs.input_ids.numel():  # every row sampled: decode and verify
            for graphs in self.graphs:
                if graphs.fits_padded(inputs.metadata):
                    return graphs.run_padded(inputs.input_ids, inputs.metadata)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def _uniform_query_len(query_lens: list[int], num_sampled_rows: int) -> int | None:
    """The tokens each request adds when all add as many and every row is sampled, else None."""
    first = query_lens[0]
    if num_sampled_rows == first * len(query_lens) and all(n == first for n in query_lens):
        return first
    return None


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights of realistic scale: N(0, 0.02) matrices, unit norms, zero biases."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _require_triton() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"CUDA runs need triton for the fused kernels ({exc}); pip install triton") from exc

"""The model runner: owns the model and the KV tensors; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the packed batch whose next token is sampled


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, source: CheckpointSource) -> None:
        self.config = config
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.block_size = config.cache.block_size
        self.vocab_size = hf_config.vocab_size
        self.backend = ATTENTION_BACKENDS["torch"]()
        self.model = self._load_model(hf_config, source)
        self.num_blocks = self._plan_kv_blocks(hf_config)
        self.kv_caches = self._allocate_kv_caches(hf_config)
        self.sampler = Sampler()

    def _load_model(self, hf_config: PretrainedConfig, source: CheckpointSource) -> LlamaForCausalLM:
        cls = model_class(hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(hf_config, self.backend, self.config.model.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        model.load_weights(iter_weights(source))
        return model.eval()

    def kv_bytes_per_block(self, hf_config: PretrainedConfig) -> int:
        per_token = 2 * hf_config.num_key_value_heads * head_dim_of(hf_config) * self.dtype.itemsize
        return per_token * hf_config.num_hidden_layers * self.block_size

    def _plan_kv_blocks(self, hf_config: PretrainedConfig) -> int:
        budget = self.config.cache.kv_cache_bytes
        if budget is None:
            budget = self._default_kv_budget(hf_config)
        num_blocks = budget // self.kv_bytes_per_block(hf_config)
        capacity = num_blocks * self.block_size
        max_len = self.config.model.max_model_len
        if capacity < max_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens but --max-model-len is {max_len}: one request "
                "could never fit; raise --kv-cache-bytes / --gpu-memory-utilization or lower --max-model-len"
            )
        logger.info("KV cache: %d blocks of %d tokens = %d tokens", num_blocks, self.block_size, capacity)
        return num_blocks

    def _default_kv_budget(self, hf_config: PretrainedConfig) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        sched = self.config.scheduler
        # Activations of one full step plus the logits of every sequence, in float32 (generous).
        activations = sched.max_num_batched_tokens * (6 * hf_config.hidden_size + 3 * hf_config.intermediate_size) * 4
        logits = sched.max_num_seqs * hf_config.vocab_size * 4 * 3
        budget = int(total * self.config.cache.gpu_memory_utilization) - used - activations - logits
        if budget <= 0:
            raise ConfigError("no GPU memory is left for the KV cache; raise --gpu-memory-utilization")
        return budget

    def _allocate_kv_caches(self, hf_config: PretrainedConfig) -> list[torch.Tensor]:
        shape = self.backend.kv_cache_shape(
            self.num_blocks, self.block_size, hf_config.num_key_value_heads, head_dim_of(hf_config)
        )
        caches = []
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            caches.append(layer.kv_cache)
        return caches

    def prepare_inputs(self, batch: ScheduledBatch, block_tables: Sequence[Sequence[int]]) -> BatchInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for request, n, table in zip(batch.requests, batch.num_new_tokens, block_tables):
            start = request.num_computed_tokens
            end = start + n
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end == request.num_tokens:
                logits_indices.append(query_start[-1] - 1)
        width = max(len(t) for t in block_tables)
        padded_tables = [list(t) + [0] * (width - len(t)) for t in block_tables]

        def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(padded_tables, torch.int32),
            slot_mapping=to_device(slots, torch.int64),
            query_lens_host=list(batch.num_new_tokens),
            seq_lens_host=seq_lens,
        )
        return BatchInputs(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            metadata=metadata,
            logits_indices=to_device(logits_indices, torch.int64),
        )

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        block_tables: Sequence[Sequence[int]],
        sampling_requests: Sequence[Request],
        allowed_masks: Sequence[torch.Tensor | None] = (),
    ) -> SamplerOutput | None:
        """Run one step; sample for `sampling_requests` (those whose last known token is computed)."""
        inputs = self.prepare_inputs(batch, block_tables)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if not sampling_requests:
            return None
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        for row, mask in enumerate(allowed_masks):
            if mask is not None:
                logits[row].masked_fill_(~mask.to(self.device, non_blocking=True), float("-inf"))
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=r.generator,
                banned_token_ids=r.banned_token_ids(),
            )
            for r in sampling_requests
        ]
        return self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

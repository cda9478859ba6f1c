"""A draft model proposer: a smaller model with the target's tokenizer drafts gamma tokens.

The draft keeps its own KV tensors but shares the target's block tables: a token's draft KV
sits in the same slot as its target KV, so the target's allocator, prefix cache and
preemption cover both. Per request, `draft_num_computed` says how many positions of the draft
cache hold the request's own tokens; a proposal first catches up from there (the prompt, or
the tokens verified since), then drafts one token per forward. Rejected drafts are forgotten
by lowering that count to the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request
from tokenmill.errors import ConfigError
from tokenmill.layers.attention import ATTENTION_BACKENDS
from tokenmill.layers.sampler import SamplingMetadata, SamplingRow, processed_probs
from tokenmill.models.llama import head_dim_of
from tokenmill.models.loader import iter_weights, load_hf_config, resolve_model
from tokenmill.models.registry import model_class
from tokenmill.runner.batch import Chunk, pack
from tokenmill.runner.model_runner import init_dummy_weights
from tokenmill.spec.draft_vocab import load_draft_vocab

if TYPE_CHECKING:
    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.runner.model_runner import ModelRunner

KV_DTYPES = {"fp8": torch.float8_e4m3fn}


class DraftModel:
    """The draft's weights, built before the target sizes its KV cache (so the memory profile
    and the per-block byte count include the draft)."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_DTYPES.get(spec.draft_kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        dummy = config.model.load_format == "dummy"
        source = resolve_model(spec.model, need_weights=not dummy)
        self.hf_config = load_hf_config(source)
        self.backend = ATTENTION_BACKENDS[config.cache.attention_backend]()
        c = self.hf_config
        self.backend.check_supported(c.num_attention_heads, c.num_key_value_heads, head_dim_of(c), self.dtype, self.kv_dtype)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(c)(c, self.backend, config.model.max_model_len, self.device.type == "cuda")
        finally:
            torch.set_default_dtype(default_dtype)
        if dummy:
            init_dummy_weights(self.model, config.model.seed + 1)
        else:
            self.model.load_weights(iter_weights(source))
        self.model.eval()
        self.vocab_ids: torch.Tensor | None = None
        if spec.draft_vocab:
            self._restrict_head(load_draft_vocab(spec.draft_vocab))

    def _restrict_head(self, ids: torch.Tensor) -> None:
        """Keep only the head rows of the draft vocabulary: row j of the head drafts token ids[j]."""
        if int(ids.max()) >= self.hf_config.vocab_size:
            raise ConfigError(f"draft_vocab has ids up to {int(ids.max())} beyond the draft's vocabulary")
        head = self.model.lm_head
        rows = head.weight.detach()[ids.to(self.device)].clone()
        self.model.lm_head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=self.device, dtype=rows.dtype)
        self.model.lm_head.weight.data.copy_(rows)
        self.vocab_ids = ids.to(self.device)

    def kv_bytes_per_block(self) -> int:
        c = self.hf_config
        return 2 * c.num_key_value_heads * head_dim_of(c) * self.kv_dtype.itemsize * c.num_hidden_layers * self.block_size

    def allocate_kv(self, num_blocks: int) -> None:
        c = self.hf_config
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, c.num_key_value_heads, head_dim_of(c))
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft: DraftModel, target: ModelRunner, kv: KVCacheManager) -> None:
        if draft.hf_config.vocab_size > target.vocab_size:
            raise ConfigError(
                f"the draft's vocabulary ({draft.hf_config.vocab_size}) is larger than the target's "
                f"({target.vocab_size}): a draft model must share the target's tokenizer"
            )
        self.draft = draft
        self.kv = kv
        self.vocab_size = target.vocab_size
        self.greedy = config.speculative.draft_sampling == "greedy"
        draft.allocate_kv(target.num_blocks + 1)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> None:
        requests = [r for r, limit in zip(requests, limits) if self._reserve(r, limit)]
        limits = [limit for r, limit in zip(requests, limits)]
        for r in requests:
            r.draft_token_ids, r.draft_probs = [], None
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(limits, default=0)):
            chunks = []
            for i in active:
                r = requests[i]
                tokens = r.all_token_ids + r.draft_token_ids
                chunks.append(Chunk(tokens[r.draft_num_computed :], r.draft_num_computed, self.kv.block_tables[r.request_id]))
                r.draft_num_computed = len(tokens)
            ids, positions, metadata = pack(chunks, self.draft.block_size, self.draft.device)
            hidden = self.draft.model(ids, positions, metadata)
            last_rows = metadata.query_start_loc[1:].long() - 1
            logits = self._full_vocab_logits(self.draft.model.compute_logits(hidden[last_rows]))
            q = processed_probs(logits, SamplingMetadata.build(
                [self._row(requests[i]) for i in active], self.vocab_size, self.draft.device))
            tokens = _sample(q).tolist()
            for i, token, row in zip(active, tokens, q):
                requests[i].draft_token_ids.append(token)
                probs[i].append(row)
            active = [i for i in active if len(requests[i].draft_token_ids) < limits[i]]
        for r, q_rows in zip(requests, probs):
            # The last draft's own KV is never computed here: the target's verify step follows.
            r.draft_num_computed = len(r.all_token_ids) + len(r.draft_token_ids) - 1
            r.draft_probs = None if self.greedy or not q_rows else torch.stack(q_rows)

    def forget(self, request_id: str) -> None:
        pass  # per-request state lives on the Request

    def _reserve(self, request: Request, limit: int) -> bool:
        """Room in the shared block table for the drafts' positions (False: draft nothing)."""
        return limit > 0 and self.kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens + limit)

    def _row(self, request: Request) -> SamplingRow:
        params = request.params
        if self.greedy and not params.greedy:
            from dataclasses import replace

            params = replace(params, temperature=0.0)
        return SamplingRow(params, request.prompt_token_ids, request.output_token_ids + request.draft_token_ids, None,
                           request.banned_token_ids(extra_outputs=len(request.draft_token_ids)))

    def _full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (-inf outside the draft vocabulary)."""
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=logits.device)
        if self.draft.vocab_ids is not None:
            full[:, self.draft.vocab_ids] = logits.float()
        else:
            full[:, : logits.shape[1]] = logits.float()
        return full


def _sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row by exponential-noise argmax (one-hot rows give their token)."""
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)

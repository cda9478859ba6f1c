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
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.kv.specs import CacheLayer, RecurrentStateSpec
from tokenmill.layers.attention import ATTENTION_BACKENDS, AttentionMetadata
from tokenmill.layers.linear import Linear
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.loader import load_hf_config, resolve_model
from tokenmill.numerics import KV_CACHE_DTYPES
from tokenmill.quantization import Fp8OnLoad
from tokenmill.quantization.nvfp4_on_load import Nvfp4OnLoad
from tokenmill.runner.batch import Chunk, flat_block_tables, pack_context
from tokenmill.runner.cuda_graphs import StepGraphs
from tokenmill.runner.memory import check_weights_fit
from tokenmill.runner.model_builder import build_model, checkpoint_quantization, engine_choices, model_weight_bytes
from tokenmill.runner.model_runner import ModelRunner, StepOutput
from tokenmill.speculative.draft_sampling import DecodeSteps as _DecodeSteps
from tokenmill.speculative.draft_sampling import DraftSampler
from tokenmill.speculative.draft_vocab import load_draft_vocab
from tokenmill.speculative.drafts import DraftingRequest
from tokenmill.transfer import to_device


class DraftModel:
    """The draft's weights, built before the target sizes its caches (so the memory profile and
    the cache plan include the draft, whose cache layers share the target's block ids)."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_CACHE_DTYPES.get(spec.draft_kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        dummy = config.model.load_format == "dummy"
        source = resolve_model(spec.model, need_weights=not dummy)
        self.hf_config = load_hf_config(source)
        self.backend = ATTENTION_BACKENDS[config.cache.attention_backend]()
        use_triton = self.device.type == "cuda"
        quantization = checkpoint_quantization(self.hf_config, source, use_triton, read_weights=not dummy,
                                               choices=engine_choices(config, self.device))
        if quantization is not None and spec.quantization:
            raise ConfigError(f"the draft checkpoint is already quantized ({quantization.name}); drop "
                              f"\"quantization\": \"{spec.quantization}\" from --speculative-config")
        if spec.quantization == "fp8":
            quantization = Fp8OnLoad(use_triton)
        elif spec.quantization == "nvfp4":
            quantization = Nvfp4OnLoad(use_triton)
        self.build = ModelBuild(self.hf_config, self.backend, config.model.max_model_len, self.block_size, self.kv_dtype,
                                use_triton, quantization)
        self.vocab_ids = load_draft_vocab(spec.draft_vocab).to(self.device) if spec.draft_vocab else None
        check_weights_fit(lambda: model_weight_bytes(self.build, self.dtype), config, self.device, "the draft model")
        self.model = build_model(self.build, source, dtype=self.dtype, device=self.device,
                                 dummy_seed=config.model.seed + 1 if dummy else None,
                                 before_processing=self._restrict_head if self.vocab_ids is not None else None)
        if any(isinstance(spec, RecurrentStateSpec) for spec in self.model.cache_specs().values()):
            raise ConfigError("the draft model has recurrent (linear-attention) layers; a draft shares the target's "
                              "block tables but has no state slots of its own: use an attention-only draft")

    def _restrict_head(self, model: CausalLM) -> None:
        """Keep only the head rows of the draft vocabulary: row j of the head drafts token ids[j]."""
        ids = self.vocab_ids
        assert ids is not None
        if int(ids.max()) >= self.hf_config.vocab_size:
            raise ConfigError(f"draft_vocab has ids up to {int(ids.max())} beyond the draft's vocabulary")
        if model.lm_head.weight.dtype in (torch.float8_e4m3fn, torch.uint8):
            raise ConfigError("draft_vocab cuts the draft's output head, but the draft checkpoint stores that head "
                              "quantized; quantize the draft with --exclude lm_head (or drop draft_vocab)")
        rows = model.lm_head.weight.detach()[ids].clone()
        model.lm_head = Linear(rows.shape[1], rows.shape[0], bias=False, device=self.device, dtype=rows.dtype,
                               method=self.build.quant.linear_method("lm_head"))
        model.lm_head.weight.data.copy_(rows)

    def cache_layers(self) -> dict[str, CacheLayer]:
        """The draft's cache layers, named apart from the target's."""
        return {f"draft.{name}": layer for name, layer in self.model.cache_layers().items()}


class DraftModelProposer:
    """Drafts gamma tokens per request with the draft model, all on the device.

    A proposal is one catch-up forward (the tokens verified since the last proposal: one or
    two in steady state, always two under CUDA graphs, where the draft recomputes the KV of
    the token before the new one) and then one single-token forward per further draft, each
    fed the token the previous one sampled without leaving the device. The drafts stay on the
    device for the verify step; the host reads them only when a request's penalties need each
    draft there. When nothing applies before the argmax (greedy drafting, no bans or
    penalties), a draft is its logits' argmax and no distribution is built.

    In steady state the catch-up does not wait for the host: `follow` launches it right behind
    the verify step, its two tokens (the last accepted one and the verify's own) chosen on the
    device from the verify's result, so under CUDA graphs the device drafts while the host
    reads that result; the proposal then starts from its logits.
    """

    def __init__(self, config: EngineConfig, draft: DraftModel, target: ModelRunner, kv: KVCacheCoordinator) -> None:
        if draft.hf_config.vocab_size > target.vocab_size:
            raise ConfigError(
                f"the draft's vocabulary ({draft.hf_config.vocab_size}) is larger than the target's "
                f"({target.vocab_size}): a draft model must share the target's tokenizer"
            )
        self.draft = draft
        self.kv = kv
        self.vocab_size = target.vocab_size
        self.sampler = DraftSampler(target.vocab_size, config.speculative.draft_sampling == "greedy", draft.vocab_ids)
        self.scratch_slot = target.num_blocks * draft.block_size
        self.max_model_len = config.model.max_model_len
        self.max_step_tokens = config.scheduler.max_num_batched_tokens
        self.decode_graphs: StepGraphs | None = None
        self.catch_up_graphs: StepGraphs | None = None
        self._followed: _FollowedCatchUp | None = None
        if target.graphs:
            max_batch = target.graphs[0].max_batch
            self.decode_graphs = target.step_graphs(draft.model, max_batch, 1, "draft decode")
            self.catch_up_graphs = target.step_graphs(draft.model, max_batch, 2, "draft catch-up")
            self.decode_graphs.capture()
            self.catch_up_graphs.capture()

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        followed, self._followed = self._followed, None  # serves the proposal right after its verify step only
        kept = [(r, limit) for r, limit in zip(requests, limits) if self._reserve(r, limit)]
        if not kept:
            return
        requests, limits = [r for r, _ in kept], [limit for _, limit in kept]
        tables = [self.kv.block_tables[r.request_id] for r in requests]
        logits = None if followed is None else followed.logits_for(requests)
        if logits is None:
            logits = self._catch_up(requests, tables)
        # Built while the device runs the catch-up step.
        steps = _DecodeSteps(requests, tables, limits, self.draft.block_size, self.scratch_slot, self.draft.device)
        self.sampler.draft(requests, limits, logits, lambda step, previous: self._decode(previous, steps.metadata(step)))
        for r, limit in zip(requests, limits):
            # The last draft's own KV is never computed here: the target's verify step follows.
            r.draft_num_computed = len(r.all_token_ids) + limit - 1

    def _catch_up(self, requests: Sequence[DraftingRequest], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Draft logits after each request's last known token, computing the tokens the draft's
        cache lacks."""
        graphs = self.catch_up_graphs
        behind = [len(r.all_token_ids) - r.draft_num_computed for r in requests]
        if graphs is not None and graphs.fits(len(requests), 2) and all(1 <= n <= 2 for n in behind):
            chunks = [Chunk(r.all_token_ids[-2:], len(r.all_token_ids) - 2, t) for r, t in zip(requests, tables)]
            return self._last_token_logits(*pack_context(chunks, self.draft.block_size, self.draft.device), graphed=True)
        return self._catch_up_eagerly(requests, tables)

    def _catch_up_eagerly(self, requests: Sequence[DraftingRequest], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """The catch-up as eager forwards of at most the step token budget each (after a prefix-cache
        hit the draft computes the whole cached prompt: one forward could outgrow the memory the
        start-up profile measured). Each forward takes every unfinished request's next piece, in
        order, until the budget is spent; a request's logits come from the forward its piece ends in."""
        starts = [r.draft_num_computed for r in requests]
        logits: list[torch.Tensor | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        while pending:
            chunks, room = [], self.max_step_tokens
            for b in pending:  # the forward takes a prefix of the pending requests
                if room == 0:
                    break
                ids = requests[b].all_token_ids
                n = min(len(ids) - starts[b], room)
                chunks.append(Chunk(ids[starts[b] : starts[b] + n], starts[b], tables[b]))
                starts[b] += n
                room -= n
            rows = self._last_token_logits(*pack_context(chunks, self.draft.block_size, self.draft.device), graphed=False)
            for b, row in zip(pending, rows):
                if starts[b] == len(requests[b].all_token_ids):
                    logits[b] = row
            pending = [b for b in pending if logits[b] is None]
        return torch.stack(logits)

    def _last_token_logits(self, ids: torch.Tensor, ctx: StepContext, graphed: bool) -> torch.Tensor:
        """Draft logits after each request's last row of a catch-up forward (graphed: two rows
        each, replayed in the catch-up graph)."""
        if graphed:
            assert self.catch_up_graphs is not None
            return self.catch_up_graphs.run(ids, ctx)[1::2]
        hidden = self.draft.model(ids, ctx)
        return self.draft.model.compute_logits(hidden[ctx.attention.query_start_loc[1:].long() - 1])

    @torch.inference_mode()
    def follow(self, scheduled: Sequence[tuple[DraftingRequest, int]], sampled: Sequence[DraftingRequest],
               step: StepOutput | None) -> None:
        self._followed = None
        self._compute_prompt_chunks(scheduled)
        if step is not None:
            self._follow_verify(sampled, step)

    def _compute_prompt_chunks(self, scheduled: Sequence[tuple[DraftingRequest, int]]) -> None:
        """The draft computes the step's prompt chunks behind the target, at the same positions and
        slots, so its cache keeps level with the target's through the prompt: its prompt pass is
        prompt processing (in the time to first token, within the step's token budget, as in
        vLLM) and the first proposal catches up one token. Only chunks the draft is level at: after
        a prefix-cache hit the first proposal's catch-up computes the cached part too."""
        chunks, levelled = [], []
        for r, n in scheduled:
            start = r.num_computed_tokens  # finish_step has not counted this step yet
            if start == r.draft_num_computed and start < len(r.prompt_token_ids) and start + n <= len(r.all_token_ids):
                chunks.append(Chunk(r.all_token_ids[start : start + n], start, self.kv.block_tables[r.request_id]))
                levelled.append((r, start + n))
        if chunks:
            self.draft.model(*pack_context(chunks, self.draft.block_size, self.draft.device))
            for r, computed in levelled:
                r.draft_num_computed = computed

    def _follow_verify(self, sampled: Sequence[DraftingRequest], step: StepOutput) -> None:
        """Launch the next proposal's catch-up behind a verify step, on the device's copy of its
        result: request b, which had L tokens and accepted a of its drafts, feeds the tokens at
        positions L + a - 1 and L + a (the last accepted token, or its last known one, and the
        verify's correction or bonus). For the requests that had drafts and a slot for that
        token, when the catch-up graph fits them (on a CPU, where reading the lengths back costs
        nothing, it runs eagerly)."""
        size, graphs = self.draft.block_size, self.catch_up_graphs
        if graphs is None and self.draft.device.type != "cpu":
            return
        batch_rows = [b for b, r in enumerate(sampled) if r.drafts.count and self._verify_slot_reserved(r)]
        if not batch_rows or graphs is not None and not graphs.fits(len(batch_rows), 2):
            return
        requests = [sampled[b] for b in batch_rows]
        device = self.draft.device
        emitted = step.sampled.sampled_token_ids  # [B, G + 1]: accepted drafts, then one token; -1 after
        if len(batch_rows) < len(sampled):
            emitted = emitted[to_device(batch_rows, torch.int64, device)]
        known, last = to_device([[r.num_tokens for r in requests], [r.all_token_ids[-1] for r in requests]],
                                torch.int64, device)
        accepted = (emitted >= 0).sum(dim=1) - 1
        candidates = torch.cat([last[:, None], emitted.clamp_min(0)], dim=1)
        columns = accepted[:, None] + torch.arange(2, device=device)
        flat, width = flat_block_tables([self.kv.block_tables[r.request_id] for r in requests])
        block_tables = to_device(flat, torch.int32, device).view(len(requests), width)
        positions = known[:, None] - 1 + columns
        slots = block_tables.gather(1, (positions // size).int()).long() * size + positions % size
        seq_lens = (known + accepted + 1).int()
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(0, 2 * len(requests) + 1, 2, dtype=torch.int32, device=device),
            seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slots.view(-1),
            query_lens_host=[2] * len(requests),
            # The graph's context bucket needs only a bound; an eager forward needs the lengths.
            seq_lens_host=[r.num_tokens + r.drafts.count + 1 for r in requests] if graphs is not None
            else seq_lens.tolist(),
        )
        ids = candidates.gather(1, columns).view(-1)
        logits = self._last_token_logits(ids, StepContext(positions.view(-1), metadata), graphed=graphs is not None)
        self._followed = _FollowedCatchUp(
            logits, {r.request_id: (b, r.num_tokens, r.num_tokens + r.drafts.count + 1) for b, r in enumerate(requests)})

    def _verify_slot_reserved(self, request: DraftingRequest) -> bool:
        """Whether the verify step's own token has a slot (position L + drafts, within the context)."""
        position = request.num_tokens + request.drafts.count
        return position < self.max_model_len and position < len(self.kv.block_tables[request.request_id]) * self.draft.block_size

    def _decode(self, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.fits(ctx.attention.num_requests, 1):
            return self.decode_graphs.run(ids, ctx)
        return self.draft.model.compute_logits(self.draft.model(ids, ctx))

    def forget(self, request_id: str) -> None:
        pass  # per-request state lives on the Request

    def _reserve(self, request: DraftingRequest, limit: int) -> bool:
        """Room in the shared block table for the drafts' positions and, within the context, one
        more: the verify's own token, which a followed catch-up writes (False: draft nothing)."""
        ahead = 1 if request.num_tokens + limit < self.max_model_len else 0
        return limit > 0 and self.kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens + limit + ahead)


@dataclass
class _FollowedCatchUp:
    logits: torch.Tensor  # [B, draft vocabulary]: after each request's verify token
    rows: dict[str, tuple[int, int, int]]  # request id: (row, tokens before the verify, most tokens after it)

    def logits_for(self, requests: Sequence[DraftingRequest]) -> torch.Tensor | None:
        """The rows of these requests, if it covered every one of them as they are now (resolved
        from its verify step: L + 1 to L + drafts + 1 tokens); else None."""
        rows = []
        for r in requests:
            row, known, most = self.rows.get(r.request_id, (-1, 0, 0))
            if row < 0 or not known < r.num_tokens <= most:
                return None
            rows.append(row)
        if rows == list(range(len(self.logits))):
            return self.logits
        return self.logits[to_device(rows, torch.int64, self.logits.device)]

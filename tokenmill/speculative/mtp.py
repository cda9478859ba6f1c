"""The MTP proposer: the target's own multi-token-prediction head drafts gamma tokens.

The head (`CausalLM.mtp_head`: one decoder layer fed the next token's embedding and the target's
hidden state) comes from the target's checkpoint and shares its embedding and output head; its
KV is one more set of paged layers (`mtp.` names) sharing the target's block ids, in
`draft_kv_cache_dtype`. Its row at position p reads the token at p + 1 and a hidden state at p,
and predicts the token at p + 2.

The head follows the target (`follow`, right behind every launched step, on the device): the
rows the target computed, at the same positions and slots, each fed the target's hidden state
at the row (`ModelRunner.last_hidden`) and the token after it: the next input row's, the next
prompt token for a chunk that ends inside the prompt, or what the step emitted for a sampled
request (a verify step's accepted drafts and its correction or bonus; rows past that are
recomputed by the next step before anything reads them). So the head's cache is always level
with the target's (`draft_num_computed` = the computed tokens, also after a prefix hit: every
cached block was followed when it was computed; the hit's last block is recomputed, since the
head's row at a block's last position depends on the token after the block), and the
proposal starts from the output at each sampled request's last accepted position: draft 1
without a forward of its own. Draft j > 1 chains: the head at the next position, fed draft
j - 1 and its own output before (vLLM's and SGLang's chaining of a one-layer MTP head). Under
CUDA graphs the following step replays a graph of the verify step's shape (1 + gamma rows per
request) or the decode step's, and each chained draft the decode graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.kv.specs import CacheLayer, RecurrentStateSpec
from tokenmill.layers.linear import Linear
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import MTP_HIDDEN, MTP_PICK, CausalLM, ModelBuild, MTPHead
from tokenmill.models.loader import CheckpointSource
from tokenmill.numerics import KV_CACHE_DTYPES
from tokenmill.runner.cuda_graphs import StepGraphs, TokenInputSpec
from tokenmill.runner.model_builder import build_mtp_head
from tokenmill.runner.model_runner import HeadParts, HiddenTap, ModelRunner, StepOutput
from tokenmill.speculative.draft_sampling import DecodeSteps, DraftSampler
from tokenmill.speculative.draft_vocab import load_draft_vocab
from tokenmill.speculative.drafts import DraftingRequest
from tokenmill.transfer import to_device


class MTPDraft:
    """Builds the target's MTP head when the target's runner calls it (a `HeadBuilder`: right
    after the target, before the memory profile and the cache plan, which then include it)."""

    def __init__(self, config: EngineConfig, source: CheckpointSource) -> None:
        spec = config.speculative
        self.config, self.source = config, source
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_CACHE_DTYPES.get(spec.draft_kv_cache_dtype, self.dtype)
        self.vocab_ids = load_draft_vocab(spec.draft_vocab).to(self.device) if spec.draft_vocab else None
        self._head: MTPHead | None = None
        self._build: ModelBuild | None = None

    @property
    def head(self) -> MTPHead:
        assert self._head is not None, "the target's runner builds the head"
        return self._head

    def __call__(self, target: CausalLM, build: ModelBuild) -> HeadParts:
        self._build = replace(build, kv_cache_dtype=self.kv_dtype)
        dummy = self.config.model.load_format == "dummy"
        self._head = build_mtp_head(target, self._build, self.source, dtype=self.dtype, device=self.device,
                                    dummy_seed=self.config.model.seed + 2 if dummy else None,
                                    before_processing=self._restrict_head if self.vocab_ids is not None else None)
        if any(isinstance(spec, RecurrentStateSpec) for spec in self._head.cache_specs().values()):
            raise ConfigError(f"the {type(target).__name__} MTP head keeps per-request state, which its cache "
                              "layers (sharing the target's block tables) cannot hold")
        layers: dict[str, CacheLayer] = {f"mtp.{name}": layer for name, layer in self._head.cache_layers().items()}
        return HeadParts(layers, HiddenTap(target.mtp_keep_hidden(), target.mtp_tap))

    def _restrict_head(self, head: MTPHead) -> None:
        """Give the head its own output head of the draft vocabulary's rows: row j drafts ids[j]."""
        ids, build = self.vocab_ids, self._build
        assert ids is not None and build is not None
        weight = head.lm_head.weight.detach()
        if int(ids.max()) >= weight.shape[0]:
            raise ConfigError(f"draft_vocab has ids up to {int(ids.max())} beyond the model's vocabulary ({weight.shape[0]})")
        if weight.dtype in (torch.float8_e4m3fn, torch.uint8):
            raise ConfigError("draft_vocab cuts the MTP head's output head, which is the target's and stored quantized "
                              "in this checkpoint; drop draft_vocab")
        rows = weight[ids].clone()
        restricted = Linear(rows.shape[1], rows.shape[0], bias=False, device=self.device, dtype=rows.dtype,
                            method=build.quant.linear_method("mtp.lm_head"))
        restricted.weight.data.copy_(rows)
        head.set_output_head(restricted)


class MTPProposer:
    """Drafts with the target's MTP head, following every target step on the device."""

    def __init__(self, config: EngineConfig, draft: MTPDraft, target: ModelRunner, kv: KVCacheCoordinator) -> None:
        self.head, self.target, self.kv = draft.head, target, kv
        self.block_size = target.block_size
        self.sampler = DraftSampler(target.vocab_size, config.speculative.draft_sampling == "greedy", draft.vocab_ids)
        self.scratch_slot = target.num_blocks * target.block_size
        self._followed: _Followed | None = None
        self.graphs: dict[int, StepGraphs] = {}  # by rows per request: the target's decode and verify shapes
        inputs = {MTP_HIDDEN: TokenInputSpec((self.head.width,), config.model.torch_dtype)}
        for graphs in target.graphs:
            q = graphs.query_len
            self.graphs[q] = target.step_graphs(self.head, graphs.max_batch, q, f"MTP {q}-row", self._picked, inputs)
            self.graphs[q].capture()

    def _picked(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """(logits, output) of each request's picked row (`MTP_PICK`): what a graph captures."""
        out = self.head(input_ids, ctx)
        picked = out[ctx.attention.query_start_loc[:-1].long() + ctx.request_inputs[MTP_PICK]]
        return self.head.compute_logits(picked), picked

    @torch.inference_mode()
    def follow(self, scheduled: Sequence[tuple[DraftingRequest, int]], sampled: Sequence[DraftingRequest],
               step: StepOutput | None) -> None:
        """The head over every row the target just computed (see the module docstring)."""
        self._followed = None
        hidden = self.target.last_hidden
        if hidden is None or not scheduled:
            return
        device = hidden.input_ids.device
        emitted = None if step is None else step.sampled.sampled_token_ids
        if emitted is not None and emitted.dim() == 1:
            emitted = emitted[:, None]  # [B, G + 1]: accepted drafts, then one token; -1 after
        width = 0 if emitted is None else emitted.shape[1]
        order = {id(r): b for b, r in enumerate(sampled)}
        last_rows, last_ids, emitted_rows, emitted_cells, first_sampled = [], [], [], [], []
        row = 0
        for r, n in scheduled:
            start = r.num_computed_tokens  # finish_step has not counted this step yet
            r.draft_num_computed = start + n
            b = order.get(id(r))
            if b is None:  # a chunk ending inside the known tokens: the next one is on the host
                last_rows.append(row + n - 1)
                last_ids.append(r.all_token_ids[start + n])
            else:
                first = row + n - r.drafts.count - 1
                emitted_rows.extend(range(first, row + n))
                emitted_cells.extend(b * width + j for j in range(r.drafts.count + 1))
                first_sampled.append(first)
            row += n
        counts = [len(last_rows), len(emitted_rows), len(first_sampled)]
        uploaded = to_device(last_rows + last_ids + emitted_rows + emitted_cells + first_sampled, torch.int64, device)
        a, c = counts[0], counts[1]
        ids = torch.cat([hidden.input_ids[1:], hidden.input_ids[:1]])  # row i reads the token of row i + 1
        if a:
            ids[uploaded[:a]] = uploaded[a : 2 * a]
        if emitted is None or not sampled:
            self.head(ids, StepContext(hidden.ctx.positions, hidden.ctx.attention, token_inputs={MTP_HIDDEN: hidden.hidden}))
            return
        ids[uploaded[2 * a : 2 * a + c]] = emitted.reshape(-1)[uploaded[2 * a + c : 2 * a + 2 * c]].clamp_min(0)
        accepted = (emitted >= 0).sum(dim=1) - 1
        ctx = StepContext(hidden.ctx.positions, hidden.ctx.attention, token_inputs={MTP_HIDDEN: hidden.hidden},
                          request_inputs={MTP_PICK: accepted})
        q = hidden.uniform_query_len
        graphs = self.graphs.get(q) if q is not None else None
        if graphs is not None and graphs.fits(ctx.attention.num_requests, q):  # every row sampled: pick = accepted
            logits, out = graphs.run_outputs(ids, ctx)
        else:
            out = self.head(ids, ctx)[uploaded[2 * a + 2 * c :] + accepted]
            logits = self.head.compute_logits(out)
        rows = {r.request_id: (b, r.num_tokens, r.num_tokens + r.drafts.count + 1) for b, r in enumerate(sampled)}
        self._followed = _Followed(logits.clone(), out.clone(), rows)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        followed, self._followed = self._followed, None  # serves the proposal right after its step only
        if followed is None:
            return
        kept, rows = [], []
        for r, limit in zip(requests, limits):
            row = followed.row_of(r)
            level = r.draft_num_computed == r.num_computed_tokens == r.num_tokens - 1
            if row is not None and level and self._reserve(r, limit):
                kept.append((r, limit))
                rows.append(row)
        if not kept:
            return
        requests, limits = [r for r, _ in kept], [limit for _, limit in kept]
        picked = to_device(rows, torch.int64, followed.logits.device)
        logits, chained = followed.logits[picked], followed.outputs[picked]
        tables = [self.kv.block_tables[r.request_id] for r in requests]
        steps = DecodeSteps(requests, tables, limits, self.block_size, self.scratch_slot, logits.device, shift=1)
        pick = torch.zeros(len(requests), dtype=torch.int64, device=logits.device)

        def next_logits(step: int, previous: torch.Tensor) -> torch.Tensor:
            nonlocal chained
            ctx = steps.metadata(step)
            ctx.token_inputs, ctx.request_inputs = {MTP_HIDDEN: chained}, {MTP_PICK: pick}
            graphs = self.graphs.get(1)
            if graphs is not None and graphs.fits(len(requests), 1):
                step_logits, chained = graphs.run_outputs(previous, ctx)
                return step_logits
            chained = self.head(previous, ctx)
            return self.head.compute_logits(chained)

        self.sampler.draft(requests, limits, logits, next_logits)

    def _reserve(self, request: DraftingRequest, limit: int) -> bool:
        """Room in the shared block table for the drafts' positions (False: draft nothing)."""
        return limit > 0 and self.kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens + limit)

    def forget(self, request_id: str) -> None:
        pass  # per-request state lives on the Request


@dataclass
class _Followed:
    logits: torch.Tensor  # [B, head vocabulary]: the head's logits at each sampled request's last accepted row
    outputs: torch.Tensor  # [B, width]: its output there, what the first chained draft reads
    rows: dict[str, tuple[int, int, int]]  # request id: (row, tokens before the step, most tokens after it)

    def row_of(self, request: DraftingRequest) -> int | None:
        """The request's row if the step it follows has been resolved into it (L + 1 to L + drafts + 1 tokens)."""
        row, known, most = self.rows.get(request.request_id, (-1, 0, 0))
        return row if row >= 0 and known < request.num_tokens <= most else None

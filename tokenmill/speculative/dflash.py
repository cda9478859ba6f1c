"""The DFlash / DFlash2 proposer: a block drafter (models/dflash.py, built by dflash_draft.py)
drafts gamma tokens in one forward.

Behind every launched target step (`follow`, on the device, before the host reads the step's
result): the context of every row the target computed (its hidden states at the drafter's
target_layer_ids, `ModelRunner.last_hidden`) goes into the drafter's cache at the rows' slots,
so the drafter's context is level with the target's cache (`draft_num_computed` = the computed
tokens; a prefix hit needs nothing recomputed: the context of a position depends on the target's
state there alone). Rows of rejected drafts leave context the next step rewrites before a block
reads it. Then, for every sampled request, the block [anchor, MASK x gamma] at positions
P..P+gamma runs, its anchor the token the step emitted (P = L + accepted drafts, on the device):
the drafts are ready when the host has resolved the step. A request the step did not serve so
(its first proposal after a preemption, a block past its reserved slots) runs its block at
proposal time, anchored at its last known token.

Drafting: DFlash draws each position from the drafter head's processed distribution at that
position (positions independent: `DraftSampler.draft_positions`); DFlash2 walks its candidate
selector from the anchor, each position drawn from the selector's row given the token drawn
before it (-inf outside the candidates), processed as any draft is. Either way q is exactly the
distribution a draft was drawn from, so token-wise and block verification stay exact.

Under CUDA graphs the context write replays graphs of the target's step shapes (1 and 1 + gamma
rows per request, the tapped states a per-token input) and the block forward a graph of 1 + gamma
rows per request whose outputs are only what drafting reads (DFlash: the logits of rows 1..gamma;
DFlash2: each position's top-k candidates, their unary scores, the projected hidden state, and
the greedy walk from the anchor, which plain greedy drafting takes as it is).
Near the end of the context (fewer than gamma + 1 positions left) a request drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import flat_block_tables
from tokenmill.runner.cuda_graphs import StepGraphs, TokenInputSpec
from tokenmill.runner.model_runner import ModelRunner, StepHidden, StepOutput
from tokenmill.speculative.dflash_draft import DFlashDraft
from tokenmill.speculative.draft_sampling import DraftSampler
from tokenmill.speculative.drafts import DraftingRequest
from tokenmill.transfer import to_device

TAPPED = "dflash_tapped"
"""StepContext.token_inputs key of the target's tapped states a context write reads."""


class DFlashProposer:
    def __init__(self, config: EngineConfig, draft: DFlashDraft, target: ModelRunner, kv: KVCacheCoordinator) -> None:
        self.model, self.spec, self.target, self.kv = draft.model, draft.spec, target, kv
        self.gamma = config.speculative.num_speculative_tokens
        self.width = self.gamma + 1  # rows of a block
        self.block_size = target.block_size
        self.max_model_len = config.model.max_model_len
        self.device = target.device
        self.sampler = DraftSampler(target.vocab_size, config.speculative.draft_sampling == "greedy", draft.vocab_ids)
        self.selector = self.model.candidate_selector
        self.disable_by_batch_size = config.speculative.disable_by_batch_size
        self._followed: _Followed | None = None
        self.context_graphs: dict[int, StepGraphs] = {}
        self.block_graphs: StepGraphs | None = None
        if target.graphs:
            tapped = {TAPPED: TokenInputSpec((len(self.spec.target_layer_ids) * self.spec.target_hidden_size,),
                                             config.model.torch_dtype)}
            for graphs in target.graphs:
                q = graphs.query_len
                self.context_graphs[q] = target.step_graphs(self.model, graphs.max_batch, q, f"DFlash context {q}-row",
                                                            self._context_step, tapped)
                self.context_graphs[q].capture()
            self.block_graphs = target.step_graphs(self.model, target.graphs[-1].max_batch, self.width, "DFlash block",
                                                   self._block_step)
            self.block_graphs.capture()

    # ---- what the graphs capture ------------------------------------------------------------

    def _context_step(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        self.model.write_context(ctx.token_inputs[TAPPED], ctx)
        return ()

    def _block_step(self, input_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """What drafting reads of a block forward, rows 1..gamma of every request (gamma rows each)."""
        hidden = self.model(input_ids, ctx)
        rows = hidden.view(-1, self.width, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
        logits = self.model.compute_logits(rows)
        if self.selector is None:
            return (logits,)
        unary, ids, projected = self.selector.candidates(logits, rows)
        shape = (-1, self.gamma)
        walk = self.selector.greedy_walk(unary.view(*shape, unary.shape[-1]), ids.view(*shape, ids.shape[-1]),
                                         projected.view(*shape, projected.shape[-1]), input_ids.view(-1, self.width)[:, 0])
        return unary, ids, projected, walk  # the greedy walk: what plain greedy drafting takes

    def _run_block(self, ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, ...]:
        graphs = self.block_graphs
        if graphs is not None and graphs.fits(ctx.attention.num_requests, self.width):
            return tuple(t.clone() for t in graphs.run_outputs(ids, ctx))
        return self._block_step(ids, ctx)

    # ---- behind a target step ---------------------------------------------------------------

    @torch.inference_mode()
    def follow(self, scheduled: Sequence[tuple[DraftingRequest, int]], sampled: Sequence[DraftingRequest],
               step: StepOutput | None) -> None:
        self._followed = None
        hidden = self.target.last_hidden
        if hidden is None or not scheduled:
            return
        for r, n in scheduled:
            r.draft_num_computed = r.num_computed_tokens + n  # finish_step has not counted this step yet
        self._write_context(hidden)
        if step is not None and sampled:
            self._follow_with_blocks(sampled, step)

    def _write_context(self, hidden: StepHidden) -> None:
        ctx = StepContext(hidden.ctx.positions, hidden.ctx.attention, token_inputs={TAPPED: hidden.hidden})
        q = hidden.uniform_query_len
        graphs = self.context_graphs.get(q) if q is not None else None
        if graphs is not None and graphs.fits(ctx.attention.num_requests, q):
            graphs.run_outputs(hidden.input_ids, ctx)
        else:
            self.model.write_context(hidden.hidden, ctx)

    def _follow_with_blocks(self, sampled: Sequence[DraftingRequest], step: StepOutput) -> None:
        """Each sampled request's next block, anchored at the token the step emitted for it (on the
        device: the step's result is not on the host yet), for the requests whose block positions
        (up to L + drafts + gamma) fit the context and have slots. On a CPU (no graphs) the
        lengths are read back for the eager forward; on a GPU without graphs it is left to propose."""
        if self.block_graphs is None and self.device.type != "cpu":
            return
        if self.disable_by_batch_size is not None and len(sampled) > self.disable_by_batch_size:
            return  # the next step speculates only if requests finish first: propose runs their blocks then
        rows = [b for b, r in enumerate(sampled) if self._room_after(r)]
        if not rows or self.block_graphs is not None and not self.block_graphs.fits(len(rows), self.width):
            return
        requests = [sampled[b] for b in rows]
        emitted = step.sampled.sampled_token_ids
        if emitted.dim() == 1:
            emitted = emitted[:, None]  # [B, G + 1]: accepted drafts, then one token; -1 after
        if len(rows) < len(sampled):
            emitted = emitted[to_device(rows, torch.int64, self.device)]
        known = to_device([r.num_tokens for r in requests], torch.int64, self.device)
        accepted = (emitted >= 0).sum(dim=1) - 1
        anchors = emitted.gather(1, accepted[:, None]).squeeze(1)
        bound = [r.num_tokens + r.drafts.count + self.width for r in requests]
        outputs = self._block(requests, anchors, known + accepted, bound)
        self._followed = _Followed(outputs, anchors, {r.request_id: (i, r.num_tokens, r.num_tokens + r.drafts.count + 1)
                                                      for i, r in enumerate(requests)})

    def _room_after(self, request: DraftingRequest) -> bool:
        """Whether the block after this step fits: positions up to L + drafts + gamma inside the
        context, with slots (given now when missing)."""
        last = request.num_tokens + request.drafts.count + self.gamma
        if last >= self.max_model_len:
            return False
        if last < len(self.kv.block_tables[request.request_id]) * self.block_size:
            return True
        return self.kv.allocate_slots(request, last + 1 - request.num_computed_tokens)

    def _block(self, requests: Sequence[DraftingRequest], anchors: torch.Tensor, starts: torch.Tensor,
               bound: list[int]) -> tuple[torch.Tensor, ...]:
        """The block forward of requests whose anchors [B] sit at positions `starts` [B] (device);
        `bound`: each request's seq_len or more (the graph's context bucket; an eager forward on
        a CPU reads the true lengths)."""
        batch, size = len(requests), self.block_size
        flat, width = flat_block_tables([self.kv.block_tables[r.request_id] for r in requests])
        tables = to_device(flat, torch.int32, self.device).view(batch, width)
        positions = starts[:, None] + torch.arange(self.width, device=self.device)
        slots = tables.gather(1, (positions // size).int()).long() * size + positions % size
        seq_lens = (starts + self.width).int()
        graphed = self.block_graphs is not None and self.block_graphs.fits(batch, self.width)
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(0, batch * self.width + 1, self.width, dtype=torch.int32, device=self.device),
            seq_lens=seq_lens, block_tables=tables, slot_mapping=slots.view(-1), query_lens_host=[self.width] * batch,
            seq_lens_host=bound if graphed and self.device.type != "cpu" else seq_lens.tolist(),
        )
        ids = torch.cat([anchors[:, None], torch.full((batch, self.gamma), self.spec.mask_token_id, dtype=torch.int64,
                                                      device=self.device)], dim=1).view(-1)
        return self._run_block(ids, StepContext(positions.view(-1), metadata))

    # ---- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        followed, self._followed = self._followed, None  # serves the proposal right after its step only
        kept = [(r, limit) for r, limit in zip(requests, limits) if self._reserve(r, limit)]
        if not kept:
            return
        rows = [followed.row_of(r) if followed is not None else None for r, _ in kept]
        early = [b for b, row in enumerate(rows) if row is not None]
        late = [b for b, row in enumerate(rows) if row is None]
        parts: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
        if early:
            assert followed is not None
            parts.append(followed.take([rows[b] for b in early]))  # type: ignore[misc]
        if late:  # blocks anchored at each late request's last known token
            late_requests = [kept[b][0] for b in late]
            starts = to_device([r.num_tokens - 1 for r in late_requests], torch.int64, self.device)
            last = to_device([r.all_token_ids[-1] for r in late_requests], torch.int64, self.device)
            parts.append((self._block(late_requests, last, starts, [r.num_tokens - 1 + self.width for r in late_requests]),
                          last))
        order = [kept[b] for b in early + late]
        requests, limits = [r for r, _ in order], [limit for _, limit in order]
        if len(parts) == 1:
            outputs, anchors = parts[0]
        else:
            outputs = tuple(torch.cat([a, b]) for a, b in zip(parts[0][0], parts[1][0]))
            anchors = torch.cat([parts[0][1], parts[1][1]])
        self._draft(requests, limits, outputs, anchors)

    def _draft(self, requests: Sequence[DraftingRequest], limits: Sequence[int], outputs: tuple[torch.Tensor, ...],
               anchors: torch.Tensor) -> None:
        batch = len(requests)
        if self.selector is None:
            self.sampler.draft_positions(requests, limits, outputs[0].view(batch, self.gamma, -1))
            return
        selector = self.selector
        unary, ids, projected = (t.view(batch, self.gamma, -1) for t in outputs[:3])
        if self.sampler.plain_greedy(requests, limits):  # every draft the best candidate: the block step's walk
            self.sampler.set_drafts(requests, limits, outputs[3].view(batch, self.gamma))
            return
        self.sampler.draft(requests, limits, selector.row(unary[:, 0], ids[:, 0], projected[:, 0], anchors),
                           lambda step, previous: selector.row(unary[:, step], ids[:, step], projected[:, step], previous))

    def _reserve(self, request: DraftingRequest, limit: int) -> bool:
        """Room for the proposal: its block (positions L - 1 .. L - 1 + gamma inside the context),
        the verify step's drafts, and when the context allows the block that follows the verify
        (up to L + limit + gamma; else a smaller reservation). False: draft nothing."""
        own_last = request.num_tokens - 1 + self.gamma
        if limit <= 0 or own_last >= self.max_model_len:
            return False
        computed = request.num_computed_tokens
        after = min(request.num_tokens + limit + self.gamma, self.max_model_len - 1)
        return self.kv.allocate_slots(request, after + 1 - computed) or self.kv.allocate_slots(request, own_last + 1 - computed)

    def forget(self, request_id: str) -> None:
        pass  # per-request state lives on the Request


@dataclass
class _Followed:
    outputs: tuple[torch.Tensor, ...]  # the block step's outputs, gamma rows per request
    anchors: torch.Tensor  # [B] each block's anchor (the token the followed step emitted)
    rows: dict[str, tuple[int, int, int]]  # request id: (row, tokens before the step, most tokens after it)

    def row_of(self, request: DraftingRequest) -> int | None:
        """The request's row if the step it follows has been resolved into it (L + 1 to L + drafts + 1 tokens)."""
        row, known, most = self.rows.get(request.request_id, (-1, 0, 0))
        return row if row >= 0 and known < request.num_tokens <= most else None

    def take(self, rows: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(the outputs of these requests' blocks, gamma rows each, in this order; their anchors)."""
        count = len(self.anchors)
        if rows == list(range(count)):
            return self.outputs, self.anchors
        index = to_device(rows, torch.int64, self.anchors.device)
        return tuple(t.view(count, -1, *t.shape[1:])[index].flatten(0, 1) for t in self.outputs), self.anchors[index]

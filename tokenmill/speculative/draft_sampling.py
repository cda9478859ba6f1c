"""Drafting gamma tokens from a proposer's head, one forward per draft: what a draft model and an
MTP head share. Each draft is its logits' argmax when nothing applies before it (greedy drafting,
no bans or penalties: q one-hot, no distribution built), else a draw from (or, drafting greedily,
the argmax of) the processed distribution, which is then the draft's q: the verify step stays
exact. The drafts stay on the device; the host reads them only when a request's penalties need
each draft there. A head restricted to a draft vocabulary drafts row j as target id ids[j].

Positions of the single-token forwards are `DecodeSteps`: step s feeds draft s at position
L + s - 1 - shift of a request of L known tokens (a draft model: shift 0; an MTP head, whose row
at p reads the token at p + 1: shift 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import flat_block_tables, slot_of
from tokenmill.sample.sampler import SamplingMetadata, SamplingRow, processed_probs, row_argmax
from tokenmill.speculative.drafts import DraftingRequest, Drafts
from tokenmill.transfer import to_device

NextLogits = Callable[[int, torch.Tensor], torch.Tensor]
"""(step s >= 1, draft s - 1 of every request [B]) -> the logits of draft s."""


class DraftSampler:
    def __init__(self, vocab_size: int, greedy: bool, vocab_ids: torch.Tensor | None) -> None:
        """vocab_size: the target's; greedy: draft each token as the argmax of its processed
        distribution (one-hot q); vocab_ids: the draft vocabulary of a restricted head, or None."""
        self.vocab_size = vocab_size
        self.greedy = greedy
        self.vocab_ids = vocab_ids

    def draft(self, requests: Sequence[DraftingRequest], limits: Sequence[int], logits: torch.Tensor,
              next_logits: NextLogits) -> None:
        """Set each request's drafts (its limit of them); `logits` are the first draft's."""
        gamma = max(limits)
        tokens = torch.empty(gamma, len(requests), dtype=torch.int64, device=logits.device)
        probs: list[torch.Tensor | None] = []  # per step; None where every row drafted its argmax
        host_drafts = any(r.params.uses_penalties for r in requests)  # penalties count every draft
        drafted: list[list[int]] = [[] for _ in requests]  # host copies, kept only under penalties
        metadata, banned = None, None
        for step in range(gamma):
            if step:
                logits = next_logits(step, tokens[step - 1])
            step_banned = [r.banned_token_ids(extra_outputs=step) for r in requests]
            if metadata is None or host_drafts or step_banned != banned:
                rows = [self._row(r, ids, bans) for r, ids, bans in zip(requests, drafted, step_banned)]
                metadata = SamplingMetadata.build(rows, self.vocab_size, logits.device)
                banned = step_banned
            if metadata.plain_greedy:
                tokens[step] = self._argmax(logits)
                probs.append(None)
            else:
                q = processed_probs(self.full_vocab_logits(logits), metadata)
                tokens[step] = row_argmax(q) if self.greedy else _sample(q)  # greedy: q is one-hot at the draft
                probs.append(None if self.greedy else q)
            if host_drafts:
                for ids, token in zip(drafted, tokens[step].tolist()):
                    ids.append(token)
        columns = tokens.T
        stacked = self._stack_probs(probs, tokens)
        for b, (r, limit) in enumerate(zip(requests, limits)):
            r.drafts = Drafts(limit, host_ids=drafted[b][:limit] if host_drafts else None, device_ids=columns[b, :limit],
                              probs=None if stacked is None else stacked[b, :limit])

    def plain_greedy(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> bool:
        """Whether every draft of these requests is its logits' argmax: greedy rows (or greedy
        drafting) with no penalty and no ban at any of their draft positions."""
        # A ban (min_tokens) at a later draft position implies one at the first.
        return all((self.greedy or r.params.greedy) and not r.params.uses_penalties and not r.banned_token_ids()
                   for r, limit in zip(requests, limits) if limit > 0)

    def draft_positions(self, requests: Sequence[DraftingRequest], limits: Sequence[int], logits: torch.Tensor) -> None:
        """Set each request's drafts from per-position logits [B, G, V'] whose positions do not
        depend on the drafts before them (a block drafter's block): each draft is drawn from its
        position's processed distribution, exactly as `draft` draws it, all positions at once;
        under penalties (which count the drafts before a position) one position at a time."""
        if any(r.params.uses_penalties for r in requests):
            self.draft(requests, limits, logits[:, 0], lambda step, previous: logits[:, step])
            return
        gamma, batch = max(limits), len(requests)
        flat = logits[:, :gamma].flatten(0, 1)
        probs = None
        if self.plain_greedy(requests, limits):
            tokens = self._argmax(flat).view(batch, gamma)
        else:
            rows = [self._row(r, [], r.banned_token_ids(extra_outputs=step)) for r in requests for step in range(gamma)]
            q = processed_probs(self.full_vocab_logits(flat), SamplingMetadata.build(rows, self.vocab_size, logits.device))
            tokens = (row_argmax(q) if self.greedy else _sample(q)).view(batch, gamma)
            probs = None if self.greedy else q.view(batch, gamma, -1)  # greedy: q is one-hot at the draft
        for b, (r, limit) in enumerate(zip(requests, limits)):
            r.drafts = Drafts(limit, device_ids=tokens[b, :limit], probs=None if probs is None else probs[b, :limit])

    @staticmethod
    def set_drafts(requests: Sequence[DraftingRequest], limits: Sequence[int], tokens: torch.Tensor) -> None:
        """Drafts [B, G] that are each their distribution's argmax (one-hot q), on the device."""
        for b, (r, limit) in enumerate(zip(requests, limits)):
            r.drafts = Drafts(limit, device_ids=tokens[b, :limit])

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's draft when nothing applies before the argmax, in the target's ids."""
        best = row_argmax(logits)
        return best if self.vocab_ids is None else self.vocab_ids[best]

    def _stack_probs(self, probs: list[torch.Tensor | None], tokens: torch.Tensor) -> torch.Tensor | None:
        """[B, gamma, V] q of every draft as sampled, or None when every draft was an argmax (one-hot q)."""
        if all(q is None for q in probs):
            return None
        one_hot = [F.one_hot(ids, self.vocab_size).float() if q is None else q for q, ids in zip(probs, tokens)]
        return torch.stack(one_hot, dim=1)

    def _row(self, request: DraftingRequest, drafted: list[int], banned: list[int]) -> SamplingRow:
        """Sampling inputs of a draft position (`drafted`: the drafts before it, under penalties)."""
        params = replace(request.params, logprobs=None)
        if self.greedy and not params.greedy:
            params = replace(params, temperature=0.0)
        return SamplingRow(params, request.prompt_token_ids, request.output_token_ids + drafted, None, banned)

    def full_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits over the target's vocabulary (-inf outside the draft vocabulary)."""
        if self.vocab_ids is None and logits.shape[1] == self.vocab_size:
            return logits
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=logits.device)
        if self.vocab_ids is not None:
            full[:, self.vocab_ids] = logits.float()
        else:
            full[:, : logits.shape[1]] = logits.float()
        return full


class DecodeSteps:
    """Positions, slots and lengths of every single-token draft step, uploaded at once.

    Step s (s >= 1) feeds draft s at position L + s - 1 - shift of a request of L known tokens. A
    request whose limit is below s rides along on its last live position, writing its KV to the
    scratch slot; its logits are ignored.
    """

    def __init__(self, requests: Sequence[DraftingRequest], tables: Sequence[Sequence[int]], limits: Sequence[int],
                 block_size: int, scratch_slot: int, device: torch.device, shift: int = 0) -> None:
        gamma = max(limits)
        positions, slots = [], []
        for step in range(1, gamma):
            step_positions, step_slots = [], []
            for r, table, limit in zip(requests, tables, limits):
                pos = len(r.all_token_ids) + min(step, limit) - 1 - shift
                step_positions.append(pos)
                step_slots.append(slot_of(table, pos, block_size) if step < limit else scratch_slot)
            positions.append(step_positions)
            slots.append(step_slots)
        self.seq_lens_host = [[p + 1 for p in row] for row in positions]
        flat, width = flat_block_tables(tables)
        self.block_tables = to_device(flat, torch.int32, device).view(len(tables), width)
        self.query_start_loc = torch.arange(len(requests) + 1, dtype=torch.int32, device=device)
        self.positions = to_device(positions, torch.int64, device)
        self.slots = to_device(slots, torch.int64, device)
        self.seq_lens = to_device(self.seq_lens_host, torch.int32, device)

    def metadata(self, step: int) -> StepContext:
        i = step - 1
        return StepContext(self.positions[i], AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens[i],
            block_tables=self.block_tables,
            slot_mapping=self.slots[i],
            query_lens_host=[1] * len(self.seq_lens_host[i]),
            seq_lens_host=self.seq_lens_host[i],
        ))


def _sample(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row by exponential-noise argmax (one-hot rows give their token)."""
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)

"""The target's side of a speculative step: every draft position verified in one call for the
whole batch.

A request with d drafts owns d + 1 consecutive logits rows (the positions of its last known
token and of each draft). Row i is processed as if the first i drafts had been sampled:
penalties see them, min_tokens counts them. Requests without drafts verify nothing and simply
sample from their one row, so one code path serves the whole batch. When every row is greedy
with nothing applied before the argmax (and in the benchmark-only accept-all mode), the target's
choices are its logits' argmax and no distribution is built. The engine describes each request
(`DraftsToVerify`); nothing here reads a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.sample.rejection import (
    VerifyInput,
    VerifyOutput,
    accept_all,
    verify_block,
    verify_greedy,
    verify_tokenwise,
)
from tokenmill.sample.sampler import SamplingMetadata, SamplingRow, gather_logprobs, processed_probs, row_argmax
from tokenmill.transfer import to_device

VERIFIERS: dict[str, Callable[[VerifyInput], VerifyOutput]] = {
    "token": verify_tokenwise,
    "block": verify_block,
}


@dataclass
class DraftsToVerify:
    """One request of a verify step: its drafts and how each of its d + 1 positions samples."""

    rows: list[SamplingRow]  # d + 1: position i processed as if the first i drafts were sampled
    host_ids: list[int] | None = None  # the drafts, when known on the host
    device_ids: torch.Tensor | None = None  # [d] int64, when known only on the device
    probs: torch.Tensor | None = None  # [d, V]: each draft's distribution as sampled; None = one-hot
    greedy: bool = False
    generator: torch.Generator | None = None
    num_accepted_fixed: int | None = None  # benchmark-only: accept this many instead of testing

    @property
    def num_drafts(self) -> int:
        return len(self.rows) - 1


@dataclass
class SpeculativeOutput:
    token_ids: torch.Tensor  # [B, G + 1]: accepted drafts, then the correction or bonus token; -1 after
    num_accepted: torch.Tensor  # [B]
    logprob_token_ids: torch.Tensor | None  # [B, G + 1, 1 + k]: emitted token's id, then the top-k
    logprobs: torch.Tensor | None


def verify_drafts(
    logits: torch.Tensor, requests: Sequence[DraftsToVerify], vocab_size: int, rule: str, accept_all_drafts: bool = False,
) -> SpeculativeOutput:
    """logits: [sum of (drafts + 1), V], request by request, position by position.
    accept_all_drafts: benchmark-only, accept every draft (or `num_accepted_fixed` of them)
    without testing; not lossless."""
    device = logits.device
    counts = [r.num_drafts for r in requests]
    batch, width = len(requests), max(counts) + 1
    rows = [row for r in requests for row in r.rows]
    metadata = SamplingMetadata.build(rows, vocab_size, device)
    flat = [b * width + i for b, d in enumerate(counts) for i in range(d + 1)]
    flat_index = to_device(flat, torch.int64, device)
    drafts = _draft_id_matrix(requests, width - 1, device)
    num_drafts = to_device(counts, torch.int64, device)
    if accept_all_drafts or metadata.plain_greedy:
        # The target's choice at each position is its logits' argmax: no distributions needed.
        target_ids = torch.zeros(batch * width, dtype=torch.int64, device=device)
        target_ids[flat_index] = row_argmax(logits)
        if not accept_all_drafts:
            result = verify_greedy(target_ids.view(batch, width), drafts, num_drafts)
        else:
            taken = to_device([d if r.num_accepted_fixed is None else min(d, r.num_accepted_fixed)
                               for r, d in zip(requests, counts)], torch.int64, device)
            result = accept_all(target_ids.view(batch, width), drafts, taken)
    else:
        probs = processed_probs(logits, metadata)
        target = torch.zeros(batch * width, probs.shape[-1], dtype=torch.float32, device=device)
        target[flat_index] = probs
        result = VERIFIERS[rule](
            VerifyInput(
                target_probs=target.view(batch, width, -1),
                draft_token_ids=drafts,
                draft_probs=_draft_probs(requests, drafts, probs.shape[-1]),
                num_drafts=num_drafts,
                greedy=to_device([r.greedy for r in requests], torch.bool, device),
                generators={b: r.generator for b, r in enumerate(requests) if r.generator is not None},
            )
        )
    k = max((r.rows[0].params.logprobs for r in requests if r.rows[0].params.logprobs is not None), default=None)
    if k is None:
        return SpeculativeOutput(result.output_token_ids, result.num_accepted, None, None)
    # Log-probabilities of the raw model distribution for whichever token each row emitted.
    emitted = result.output_token_ids.view(-1)[flat_index].clamp_min(0)
    ids, values = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), emitted, k)
    out_ids = torch.zeros(batch * width, ids.shape[1], dtype=ids.dtype, device=device)
    out_values = torch.zeros(batch * width, ids.shape[1], dtype=values.dtype, device=device)
    out_ids[flat_index], out_values[flat_index] = ids, values
    return SpeculativeOutput(
        result.output_token_ids, result.num_accepted, out_ids.view(batch, width, -1), out_values.view(batch, width, -1)
    )


def _draft_id_matrix(requests: Sequence[DraftsToVerify], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] int64 drafts, row by row, zero padding after each row's count (two writes at most:
    the drafts known on the host, and those left on the device)."""
    matrix = torch.zeros(len(requests) * width, dtype=torch.int64, device=device)
    host_index: list[int] = []
    host_ids: list[int] = []
    device_index: list[int] = []
    device_ids: list[torch.Tensor] = []
    for b, r in enumerate(requests):
        if r.host_ids is not None:
            host_index.extend(range(b * width, b * width + r.num_drafts))
            host_ids.extend(r.host_ids)
        elif r.num_drafts:
            assert r.device_ids is not None
            device_index.extend(range(b * width, b * width + r.num_drafts))
            device_ids.append(r.device_ids)
    if host_index:
        matrix[to_device(host_index, torch.int64, device)] = to_device(host_ids, torch.int64, device)
    if device_index:
        matrix[to_device(device_index, torch.int64, device)] = torch.cat(device_ids)
    return matrix.view(len(requests), width)


def _draft_probs(requests: Sequence[DraftsToVerify], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """q for every draft: as recorded by the proposer, or one-hot where it drafted deterministically."""
    width = drafts.shape[1]
    if width == 0 or all(r.probs is None for r in requests):
        return None
    q = torch.zeros(len(requests), width, vocab, dtype=torch.float32, device=drafts.device)
    for b, r in enumerate(requests):
        d = r.num_drafts
        if r.probs is not None:
            q[b, :d] = r.probs.to(drafts.device)
        elif d:
            q[b, :d] = F.one_hot(drafts[b, :d], vocab)
    return q

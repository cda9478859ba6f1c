"""The target's side of a speculative step: processed distributions at every draft position,
verified in one call for the whole batch.

A request with d drafts owns d + 1 consecutive logits rows (the positions of its last known
token and of each draft). Row i is processed as if the first i drafts had been sampled:
penalties see them, min_tokens counts them. Requests without drafts verify nothing and simply
sample from their one row, so one code path serves the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.config import BENCHMARK_ACCEPT_ALL
from tokenmill.engine.request import Request
from tokenmill.layers.sampler import SamplingMetadata, SamplingRow, gather_logprobs, processed_probs
from tokenmill.spec.verify import VerifyInput, VerifyOutput, verify_block, verify_tokenwise


def accept_all(inp: VerifyInput) -> VerifyOutput:
    """Benchmark-only (config refuses it without an explicit opt-in): every draft is accepted and
    the bonus token is the argmax after the last one. Not lossless."""
    batch, width = inp.target_probs.shape[:2]
    out = torch.full((batch, width), -1, dtype=torch.int64, device=inp.target_probs.device)
    out[:, : width - 1] = inp.draft_token_ids
    bonus = inp.target_probs.argmax(-1).gather(1, inp.num_drafts[:, None])
    out.scatter_(1, inp.num_drafts[:, None], bonus)
    return VerifyOutput(output_token_ids=out, num_accepted=inp.num_drafts.clone())


VERIFIERS: dict[str, Callable[[VerifyInput], VerifyOutput]] = {
    "token": verify_tokenwise,
    "block": verify_block,
    BENCHMARK_ACCEPT_ALL: accept_all,
}


@dataclass
class SpeculativeOutput:
    token_ids: torch.Tensor  # [B, G + 1]: accepted drafts, then the correction or bonus token; -1 after
    num_accepted: torch.Tensor  # [B]
    logprob_token_ids: torch.Tensor | None  # [B, G + 1, 1 + k]: emitted token's id, then the top-k
    logprobs: torch.Tensor | None


def rows_per_request(requests: Sequence[Request]) -> list[int]:
    return [len(r.draft_token_ids) + 1 for r in requests]


def verify_drafts(
    logits: torch.Tensor, requests: Sequence[Request], vocab_size: int, rule: str
) -> SpeculativeOutput:
    """logits: [sum of rows_per_request, V], request by request, position by position."""
    device = logits.device
    counts = [len(r.draft_token_ids) for r in requests]
    batch, width = len(requests), max(counts) + 1
    rows = [
        SamplingRow(
            params=r.params,
            prompt_token_ids=r.prompt_token_ids,
            output_token_ids=r.output_token_ids + r.draft_token_ids[:i],
            generator=None,
            banned_token_ids=r.banned_token_ids(extra_outputs=i),
        )
        for r, d in zip(requests, counts)
        for i in range(d + 1)
    ]
    probs = processed_probs(logits, SamplingMetadata.build(rows, vocab_size, device))
    flat = [b * width + i for b, d in enumerate(counts) for i in range(d + 1)]
    flat_index = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    target = torch.zeros(batch * width, probs.shape[-1], dtype=torch.float32, device=device)
    target[flat_index] = probs
    drafts = torch.zeros(batch, max(width - 1, 1), dtype=torch.int64)
    for b, r in enumerate(requests):
        drafts[b, : len(r.draft_token_ids)] = torch.tensor(r.draft_token_ids, dtype=torch.int64)
    result = VERIFIERS[rule](
        VerifyInput(
            target_probs=target.view(batch, width, -1),
            draft_token_ids=drafts[:, : width - 1].to(device, non_blocking=True),
            draft_probs=_draft_probs(requests, width - 1, probs.shape[-1], device),
            num_drafts=torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True),
            greedy=torch.tensor([r.params.greedy for r in requests]).to(device, non_blocking=True),
            generators={b: r.generator for b, r in enumerate(requests) if r.generator is not None},
        )
    )
    k = max((r.params.logprobs for r in requests if r.params.logprobs is not None), default=None)
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


def _draft_probs(requests: Sequence[Request], width: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """q for every draft: as recorded by the proposer, or one-hot where it drafted deterministically."""
    if width == 0 or all(r.draft_probs is None for r in requests):
        return None
    q = torch.zeros(len(requests), width, vocab, dtype=torch.float32, device=device)
    for b, r in enumerate(requests):
        d = len(r.draft_token_ids)
        if r.draft_probs is not None:
            q[b, :d] = r.draft_probs.to(device)
        elif d:
            q[b, torch.arange(d, device=device), torch.tensor(r.draft_token_ids, device=device)] = 1.0
    return q

"""Batched token sampling without host synchronisation.

Order per step (as vLLM v1):
  1. raw logprobs = log_softmax(logits) in float32 (what the model said; before any processing)
  2. banned ids -> -inf (the engine bans EOS/stop ids while below min_tokens)
  3. penalties: repetition over prompt+output tokens, presence/frequency over output tokens
  4. greedy rows: argmax
  5. random rows: temperature, top-k, top-p, min-p, then argmax(probs / Exp(1) noise)

Everything per-request lives in `SamplingMetadata`, built once per step on the host and copied
to the device without blocking. `Sampler.forward` never reads a tensor value on the host
(no .item()/.tolist()/.cpu()/nonzero/boolean indexing), so sampled ids can stay on the GPU.

Steps 2-5 live in `process_logits`, shared by `Sampler.forward` and `processed_probs` (the exact
distribution sampled from, which speculative verification uses as the target p).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from tokenmill.sampling_params import SamplingParams

# Temperatures below this are greedy (avoids dividing logits by ~0).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingRow:
    """One logits row's sampling inputs, built by the runner."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # per-request, seeded; None draws from the global RNG
    banned_token_ids: Sequence[int] = ()  # masked this step only


@dataclass
class PenaltyTensors:
    """Penalty inputs; token positions are flat indices row * vocab_size + token_id."""

    repetition: torch.Tensor  # [N, 1] float32 (1.0 = off)
    presence: torch.Tensor  # [N, 1] float32 (0.0 = off)
    frequency: torch.Tensor  # [N, 1] float32 (0.0 = off)
    prompt_flat_ids: torch.Tensor  # [P] int64, prompt tokens of rows with repetition penalty
    output_flat_ids: torch.Tensor  # [O] int64, output tokens of rows with any penalty


@dataclass
class SamplingMetadata:
    """Per-batch sampling tensors. Only what some row uses is materialised (others are None)."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [N] bool; only for mixed batches
    temperature: torch.Tensor | None  # [N, 1] float32; None when all greedy (greedy rows: 1.0)
    top_k: torch.Tensor | None  # [N, 1] int64 in [1, V]; disabled rows hold V
    max_top_k: int  # largest enabled top_k (0 when top_k is None); sizes the topk() call
    top_p: torch.Tensor | None  # [N, 1] float32; disabled rows hold 1.0
    min_p: torch.Tensor | None  # [N, 1] float32; disabled rows hold 0.0
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # random rows only
    max_num_logprobs: int | None = None  # k of the [N, 1 + k] logprobs output; None = no logprobs
    banned_flat_ids: torch.Tensor | None = None  # [B] int64 flat indices to set to -inf
    penalties: PenaltyTensors | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy with nothing to apply first: the sample is the logits' argmax."""
        return self.all_greedy and self.banned_flat_ids is None and self.penalties is None and self.max_num_logprobs is None

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        n = len(rows)
        greedy = [r.params.temperature < _SAMPLING_EPS for r in rows]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        pin = torch.device(device).type == "cuda"

        def upload(values: list, dtype: torch.dtype, column: bool = False) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype, pin_memory=pin)
            if column:
                t = t.unsqueeze(1)
            return t.to(device, non_blocking=True)

        def upload_array(values: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(values)
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        greedy_mask = None if all_greedy or all_random else upload(greedy, torch.bool)
        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            random_rows = [(i, r.params) for i, r in enumerate(rows) if not greedy[i]]
            temperature = upload(
                [1.0 if g else r.params.temperature for g, r in zip(greedy, rows)],
                torch.float32,
                column=True,
            )
            enabled_k = [p.top_k for _, p in random_rows if 0 < p.top_k < vocab_size]
            if enabled_k:
                max_top_k = max(enabled_k)
                top_k = upload(
                    [
                        vocab_size if g or not 0 < r.params.top_k < vocab_size else r.params.top_k
                        for g, r in zip(greedy, rows)
                    ],
                    torch.int64,
                    column=True,
                )
            if any(p.top_p < 1.0 for _, p in random_rows):
                top_p = upload(
                    [1.0 if g else r.params.top_p for g, r in zip(greedy, rows)],
                    torch.float32,
                    column=True,
                )
            if any(p.min_p > 0.0 for _, p in random_rows):
                min_p = upload(
                    [0.0 if g else r.params.min_p for g, r in zip(greedy, rows)],
                    torch.float32,
                    column=True,
                )
            generators = {
                i: r.generator
                for i, r in enumerate(rows)
                if not greedy[i] and r.generator is not None
            }

        requested = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        max_num_logprobs = min(max(requested), vocab_size) if requested else None

        banned = _flat_token_ids([(i, r.banned_token_ids) for i, r in enumerate(rows)], vocab_size)
        banned_flat_ids = upload_array(banned) if len(banned) else None

        penalties = None
        if any(r.params.uses_penalties for r in rows):
            prompt_flat = _flat_token_ids(
                [(i, r.prompt_token_ids) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0],
                vocab_size,
            )
            output_flat = _flat_token_ids(
                [(i, r.output_token_ids) for i, r in enumerate(rows) if r.params.uses_penalties],
                vocab_size,
            )
            penalties = PenaltyTensors(
                repetition=upload(
                    [r.params.repetition_penalty for r in rows], torch.float32, column=True
                ),
                presence=upload([r.params.presence_penalty for r in rows], torch.float32, True),
                frequency=upload([r.params.frequency_penalty for r in rows], torch.float32, True),
                prompt_flat_ids=upload_array(prompt_flat),
                output_flat_ids=upload_array(output_flat),
            )

        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            banned_flat_ids=banned_flat_ids,
            penalties=penalties,
        )


def _flat_token_ids(rows: list[tuple[int, Sequence[int]]], vocab_size: int) -> np.ndarray:
    """row * vocab_size + token_id for every (row, ids) pair, out-of-range ids dropped (host side)."""
    lengths = [len(ids) for _, ids in rows]
    total = sum(lengths)
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ids = np.fromiter(chain.from_iterable(ids for _, ids in rows), dtype=np.int64, count=total)
    bases = np.repeat(np.array([i for i, _ in rows], dtype=np.int64) * vocab_size, lengths)
    valid = (ids >= 0) & (ids < vocab_size)
    return (ids + bases)[valid]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64, on device
    logprob_token_ids: torch.Tensor | None  # [N, 1 + k] int64: sampled id, then the top-k ids
    logprobs: torch.Tensor | None  # [N, 1 + k] float32, matching (raw model distribution)


class Sampler(torch.nn.Module):
    """logits [N, V] (any float dtype) -> sampled ids; computes in float32, never syncs."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        _check_shape(logits, metadata)
        if metadata.plain_greedy:  # argmax of the raw logits: no copy (float32 widening is exact)
            return SamplerOutput(row_argmax(logits), None, None)
        # A private float32 copy: the caller's logits are never modified.
        logits = logits.to(dtype=torch.float32, copy=True)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        greedy_ids, probs = process_logits(logits, metadata)
        if probs is None:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            sampled = exponential_argmax(probs, metadata.generators)
            if greedy_ids is not None:
                assert metadata.greedy_mask is not None
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        token_ids, logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs)


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The one processing path shared by `Sampler` and `processed_probs`.

    `logits` is a private float32 [N, V] copy (edited in place). Returns (greedy_ids, probs):
    greedy_ids [N] is the argmax after bans and penalties (None when every row is random);
    probs [N, V] float32 is the distribution random rows sample from, after temperature, top-k,
    top-p and min-p (None when every row is greedy; greedy rows of a mixed batch hold an unused
    temperature-1 distribution there).
    """
    if metadata.banned_flat_ids is not None:
        logits.view(-1).index_fill_(0, metadata.banned_flat_ids, float("-inf"))
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    if metadata.all_greedy:
        return row_argmax(logits), None
    # Greedy ids before the random path edits logits in place.
    greedy_ids = None if metadata.all_random else row_argmax(logits)
    assert metadata.temperature is not None
    logits = logits.div_(metadata.temperature)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return greedy_ids, torch.softmax(logits, dim=-1)


def row_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """argmax of each row (the first maximum), in two passes when rows are few and long: torch
    reduces a row in one thread block, while chunks of `chunk` spread the first pass over the
    machine."""
    rows, vocab = logits.shape
    if rows >= 32 or vocab % chunk or vocab <= 8 * chunk:
        return logits.argmax(dim=-1)
    values, offsets = logits.view(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1)
    return best * chunk + offsets.gather(1, best[:, None]).squeeze(1)


def processed_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[N, V] float32: exactly the distribution `Sampler` samples each row from (bans, penalties,
    temperature, top-k, top-p, min-p applied; greedy rows one-hot at their argmax). This is the
    target distribution p that speculative verification needs. Never syncs; logits untouched."""
    _check_shape(logits, metadata)
    greedy_ids, probs = process_logits(logits.to(dtype=torch.float32, copy=True), metadata)
    if greedy_ids is None:
        assert probs is not None
        return probs
    one_hot = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    one_hot.scatter_(1, greedy_ids.unsqueeze(1), 1.0)
    if probs is None:
        return one_hot
    assert metadata.greedy_mask is not None
    return torch.where(metadata.greedy_mask.unsqueeze(1), one_hot, probs)


def _check_shape(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.shape != (metadata.num_rows, metadata.vocab_size):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match the sampling metadata "
            f"({metadata.num_rows} rows, vocab size {metadata.vocab_size})"
        )


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """vLLM/OpenAI penalties. Repetition: divide positive / multiply negative logits of tokens seen
    in the prompt or output; then logit -= frequency * count + presence * (count > 0) (output only)."""
    n, v = logits.shape
    counts = torch.zeros(n * v, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(0, p.output_flat_ids, torch.ones_like(p.output_flat_ids, dtype=torch.float32))
    counts = counts.view(n, v)
    output_mask = counts > 0
    seen = torch.zeros(n * v, dtype=torch.bool, device=logits.device)
    seen.index_fill_(0, p.prompt_flat_ids, True)
    seen = seen.view(n, v) | output_mask
    rep = torch.where(seen, p.repetition, 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - p.frequency * counts - p.presence * output_mask.to(torch.float32)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Masks (with -inf) tokens outside each row's top-k, then outside the smallest set of most
    likely tokens whose renormalised mass reaches top_p. Ties at the k-th value are kept."""
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        assert top_k is not None
        # Only top-k: the k-th largest value is the threshold; topk(max_k) instead of a full sort.
        v = logits.shape[-1]
        max_k = max_top_k if 0 < max_top_k <= v else v
        kth = logits.topk(max_k, dim=-1).values.gather(1, top_k.clamp(max=max_k) - 1)
        kth = torch.where(top_k < v, kth, float("-inf"))  # rows holding V are unfiltered
        return logits.masked_fill_(logits < kth, float("-inf"))

    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    v = logits.shape[-1]
    if top_k is not None:
        kth = logits_sort.gather(1, v - top_k)
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    # Drop the least likely tokens whose cumulative mass stays within 1 - p; always keep the top.
    drop = probs_sum <= 1 - top_p
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the most likely token's."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf disables the row.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def exponential_argmax(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Samples each row from probs as argmax(probs / E), E ~ Exp(1) i.i.d. (the Gumbel-max trick
    in another form). Seeded rows draw all their noise from their own generator, so a seeded
    request's tokens do not depend on which other requests share the batch."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for i, generator in generators.items():
        noise[i].exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 1 + k] ids and logprobs: the sampled token first, then the k most likely tokens."""
    sampled = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled)
    if not k:
        return sampled, sampled_lp
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1)

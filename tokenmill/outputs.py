"""What the engine hands back: per-step deltas for streaming, and whole results offline."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities: the chosen token's, then the top-n alternatives.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One sampled sequence. Offline: the whole answer. Streaming: the delta of one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that matched


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    spec: SpecUsage | None = None  # speculative decoding so far (None when it is off)
    # With a steering file, on the final output: per direction, the residual stream's projection on it
    # (at the direction's layer) at the rows that sampled the first outputs (the refusal detector's input).
    direction_projections: dict[str, list[float]] | None = None


@dataclass
class SpecUsage:
    """One request's speculative decoding, cumulative: verify steps that carried drafts, drafts
    proposed, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

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

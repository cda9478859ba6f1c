"""A request's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.engine.structured_output import GrammarMatcher
from tokenmill.outputs import SpecUsage, TokenLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.drafts import NO_DRAFTS, Drafts


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. The scheduling rule: `num_computed_tokens` catches up with `num_tokens`.

    Invariant: num_computed_tokens <= num_tokens; a step that brings num_computed_tokens to
    num_tokens samples one more token (which makes num_tokens grow by one). Under async
    scheduling that token is a placeholder until its step is resolved: it counts in
    num_tokens, its id lives only on the device, and all_token_ids does not have it yet.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    steering: dict[str, float] = field(default_factory=dict)  # direction -> strength (nonzero ones only)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + outputs known on the host
    num_placeholders: int = 0
    drafts: Drafts = NO_DRAFTS
    draft_num_computed: int = 0  # positions of a draft model's cache that hold this request's tokens
    spec_usage: SpecUsage | None = None
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured output: the tokens allowed next
    block_hashes: list[bytes] = field(default_factory=list)
    # Per steered direction, the stream's projection on it at the rows that sampled the first outputs.
    direction_projections: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def cache_tags(self) -> tuple[tuple[str, str], ...]:
        """What besides the tokens and cache_salt decides this request's KV: its steering strengths
        (exactly: float.hex). Strength 0 computes what no steering does, so it is no tag."""
        return tuple((f"steering.{name}", float.hex(value)) for name, value in sorted(self.steering.items()) if value)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_tokens_with_drafts(self) -> int:
        return self.num_tokens + self.drafts.count

    def drop_drafts(self) -> None:
        self.drafts = NO_DRAFTS

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_placeholders

    @property
    def reached_max_tokens(self) -> bool:
        return self.num_output_tokens >= self.max_tokens

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_stop_token(self) -> None:
        """Finish on EOS, a stop token or max_tokens, after a token was appended."""
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.finish("stop", None)
                return
            if last in self.params.stop_token_ids:
                self.finish("stop", last)
                return
        if n_out >= self.max_tokens:
            self.finish("length")

    def banned_token_ids(self, extra_outputs: int = 0) -> list[int]:
        """Tokens that may not be sampled now (or after `extra_outputs` more tokens, as at a
        draft position): stop tokens and EOS while below min_tokens."""
        if self.num_output_tokens + extra_outputs >= self.params.min_tokens:
            return []
        banned = list(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return banned

"""Per-request sampling parameters, validated once when the request is made."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.errors import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint on the whole answer, enforced token by token by constrained decoding.

    kind "json_object": any JSON object; "json_schema": JSON matching `value` (a schema as a
    JSON string); "regex" and "grammar" (EBNF/GBNF text) for callers that need them.

    `compiled` is the grammar already compiled against the engine's vocabulary (the server
    compiles it on a worker thread; the engine then only makes a matcher from it). Left None,
    the engine compiles it in add_request.
    """

    kind: str
    value: str | None = None
    compiled: Any = field(default=None, compare=False, repr=False)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and defaults).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    logprobs=None returns no log-probabilities; logprobs=k returns the sampled token's and the
    k most likely tokens' log-probabilities (k may be 0).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k < 0:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            fail(f"logprobs must be >= 0, got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative token ids")

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n parallel samples: n=1, and seed+index if seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

"""Constrained decoding: a grammar (JSON schema, JSON object, regex, EBNF) picks the tokens
that may come next, so even a small model returns output that parses.

Built on xgrammar, which compiles a grammar against the tokenizer's vocabulary once and then
answers "which tokens are allowed now" with a bitmask in microseconds. Compiling can take
seconds, so the server compiles on a worker thread and hands the engine the compiled grammar;
the engine makes one matcher per constrained request (and compiles only for offline callers).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputSpec

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "grammar")
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[22:18:25] /project/cpp/x.cc:94: "


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a declared dependency
        raise InvalidRequestError(
            "structured output needs the `xgrammar` package: pip install xgrammar"
        ) from exc
    return xgrammar


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack xgrammar's int32 bitmask [..., ceil(V/32)] into a bool mask [..., V]."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


class GrammarMatcher:
    """The grammar state of one request: which tokens may come next, and whether it is done."""

    def __init__(self, matcher: Any, vocab_size: int, xgr: Any) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._failed = False

    def allowed_token_mask(self) -> torch.Tensor:
        """bool [vocab_size] on the CPU: True where a token keeps the output inside the grammar."""
        if self.is_terminated():
            mask = torch.zeros(self._vocab_size, dtype=torch.bool)
            stop_ids = [t for t in self._matcher.stop_token_ids if 0 <= t < self._vocab_size]
            mask[stop_ids] = True
            return mask
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return bitmask_to_bool(self._bitmask[0], self._vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write this request's packed mask into row `index` of an int32 bitmask
        (allocate it with StructuredOutputManager.allocate_bitmask): the batched fast path."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> None:
        """Advance the grammar by the sampled token. A token the grammar refuses (the caller
        sampled outside the mask) ends the constrained output instead of raising."""
        if self._failed or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(int(token_id)):
            logger.warning("grammar refused token %d; ending the constrained output", token_id)
            self._failed = True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (speculative decoding rejects drafted tokens)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token (or was broken by a refused token)."""
        return self._failed or self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the output so far is a complete sentence of the grammar."""
        return self._matcher.is_completed()


class StructuredOutputManager:
    """Compiles grammars against one tokenizer's vocabulary and hands out matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_threads: int = 2) -> None:
        self._xgr = _import_xgrammar()
        self.vocab_size = vocab_size
        info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=max_threads)
        self._lock = threading.Lock()

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """An int32 bitmask [batch_size, ceil(vocab/32)] for GrammarMatcher.fill_bitmask."""
        return self._xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar for a spec; InvalidRequestError when the spec is unusable."""
        kind, value = spec.kind, spec.value
        if kind not in STRUCTURED_OUTPUT_KINDS:
            raise InvalidRequestError(
                f"unknown structured output kind {kind!r}; use one of {STRUCTURED_OUTPUT_KINDS}"
            )
        if kind != "json_object" and not value:
            raise InvalidRequestError(f"structured output of kind {kind!r} needs a value")
        try:
            with self._lock:
                if kind == "json_object":
                    # Compact JSON: a small model left free to add whitespace may never stop.
                    return self._compiler.compile_json_schema(
                        '{"type": "object"}', any_whitespace=False
                    )
                if kind == "json_schema":
                    schema = json.loads(value) if isinstance(value, str) else value
                    if not isinstance(schema, (dict, bool)):
                        raise InvalidRequestError("a JSON schema must be an object")
                    return self._compiler.compile_json_schema(
                        json.dumps(schema), any_whitespace=False, strict_mode=True
                    )
                if kind == "regex":
                    return self._compiler.compile_regex(value)
                return self._compiler.compile_grammar(value)
        except InvalidRequestError:
            raise
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from exc
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            lines = str(exc).strip().splitlines()
            message = _XGR_LOCATION.sub("", lines[0]) if lines else type(exc).__name__
            raise InvalidRequestError(f"invalid {kind} for structured output: {message}") from exc

    def new_matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        return matcher_for(self.compile(spec), self.vocab_size)


def matcher_for(compiled: Any, vocab_size: int) -> GrammarMatcher:
    """A matcher over a grammar compiled ahead (StructuredOutputSpec.compiled): microseconds."""
    xgr = _import_xgrammar()
    if compiled.tokenizer_info.vocab_size != vocab_size:
        raise ValueError(f"the grammar was compiled for a vocabulary of {compiled.tokenizer_info.vocab_size} "
                         f"tokens, not this model's {vocab_size}")
    return GrammarMatcher(xgr.GrammarMatcher(compiled), vocab_size, xgr)

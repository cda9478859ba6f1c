"""Incremental detokenization with stop strings, for streaming.

Text is decoded over a small sliding window of token ids (the prefix/read offset method of TGI and
vLLM): `decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the text the new tokens add, and
the shared prefix gives tokenizers that drop a leading space at the start of a decode (SentencePiece)
the context they need. Text ending in U+FFFD is a multi-byte character split across byte-level
tokens; it is held back until a later token completes it, so a stream never carries broken UTF-8.

Stop strings are searched in the decoded text. A match is the stop string that is *completed*
earliest in the text (ties: the one starting first), which does not depend on how the text was
split into tokens. While running, the last (longest stop - 1) characters are held back, so a
stream never emits text that a later match would cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenmill.sampling_params import SamplingParams

# Prompt tokens kept as decode context for the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
# Ids before the window are dropped once this many have piled up.
_TRIM_AFTER = 64
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into stable text deltas; detects stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # With include_stop_str_in_output, text before a later match is kept anyway.
        longest = max((len(s) for s in self.stop_strings), default=0)
        self._hold = 0 if self.include_stop_str_in_output else max(longest - 1, 0)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context  # the window's ids (and some already-read ones)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # ids before this are already in output_text

        self.output_text = ""  # full text so far, after stop-string truncation
        self.stop_reason: str | None = None  # the stop string that matched, if any
        self._emitted = 0  # characters of output_text already returned
        self._done = False

    # ----------------------------------------------------------------------------- public

    def append(self, token_ids: Sequence[int]) -> str:
        """Decode new tokens; return the newly stable text to stream (possibly "")."""
        if self._done or not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text, complete = self._decode_window()
        if complete:
            self._advance()
            self._add_text(new_text)
        else:
            # Held back for an unfinished character; the text before it may still finish a stop
            # string (a multi-token append), and then the request ends here.
            self._add_text(new_text.rstrip(_REPLACEMENT_CHAR), commit=False)
        return self._release(final=self._done)

    def finish(self) -> str:
        """At the end (length, EOS, abort): release all held-back text, incomplete or not."""
        if not self._done:
            if self._read_offset < len(self._ids):
                new_text, _ = self._decode_window()
                self._advance()
                self._add_text(new_text)
            self._done = True
        return self._release(final=True)

    @property
    def finished(self) -> bool:
        return self._done

    # ---------------------------------------------------------------------------- private

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_window(self) -> tuple[str, bool]:
        """(text added by ids[read:], whether it ends on a complete character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return "", False  # nothing new yet (e.g. a skipped special token)
        new_text = full_text[len(prefix_text) :]
        return new_text, not new_text.endswith(_REPLACEMENT_CHAR)

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > _TRIM_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _add_text(self, new_text: str, commit: bool = True) -> None:
        """Append decoded text and look for a stop string completed inside it. Uncommitted text
        is only searched: it is kept only if it holds a match (which ends the request)."""
        if not new_text:
            return
        old_len = len(self.output_text)
        text = self.output_text + new_text
        match = self._find_stop(text, old_len)
        if match is not None:
            stop, start, end = match
            self.output_text = text[:end] if self.include_stop_str_in_output else text[:start]
            self.stop_reason = stop
            self._done = True
        elif commit:
            self.output_text = text

    def _find_stop(self, text: str, old_len: int) -> tuple[str, int, int] | None:
        """The stop string completed first among those ending after old_len."""
        best: tuple[str, int, int] | None = None
        for stop in self.stop_strings:
            start = text.find(stop, max(0, old_len - len(stop) + 1))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[2], best[1]):
                best = (stop, start, end)
        return best

    def _release(self, final: bool) -> str:
        upto = len(self.output_text) if final else len(self.output_text) - self._hold
        if upto <= self._emitted:
            return ""
        delta = self.output_text[self._emitted : upto]
        self._emitted = upto
        return delta

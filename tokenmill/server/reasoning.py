"""Reasoning parsers: split `<think>...</think>` off the answer into `reasoning_content`.

One streaming state machine serves both the streamed and the whole-answer paths (the whole
answer is fed in one piece and then flushed), so both always agree.

- deepseek_r1: the answer starts inside the thought (its template opens `<think>` in the prompt),
  so text before `</think>` is reasoning even without an opening tag.
- qwen3 (also `think`): reasoning only when the answer opens with `<think>`, or when the prompt
  itself ends with an open `<think>`; otherwise everything is content.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3", "think")


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningStream:
    START, END = "<think>", "</think>"

    def __init__(self, start_in_reasoning: bool) -> None:
        self._in_reasoning = start_in_reasoning
        self._opening = True  # the answer may still begin with <think>
        self._after_end = False  # drop the whitespace right after </think>
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        if self._opening:
            stripped = self._buf.lstrip()
            if stripped.startswith(self.START):
                self._buf = stripped[len(self.START) :]
                self._in_reasoning = True
                self._opening = False
            elif self.START.startswith(stripped):
                return out  # still could be the opening tag (or only whitespace so far)
            else:
                self._opening = False
        if self._in_reasoning:
            end = self._buf.find(self.END)
            if end < 0:
                keep = _partial_suffix(self._buf, self.END)
                out.reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(out.reasoning) :]
                return out
            out.reasoning = self._buf[:end]
            self._buf = self._buf[end + len(self.END) :]
            self._in_reasoning = False
            self._after_end = True
        if self._after_end:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return out
            self._after_end = False
        out.content, self._buf = self._buf, ""
        return out

    def finish(self) -> ReasoningDelta:
        text, self._buf = self._buf, ""
        if self._in_reasoning:
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text if not self._after_end else text.lstrip())


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; use one of {REASONING_PARSERS}")
        self.name = name

    def new_stream(self, prompt_text: str | None = None) -> ReasoningStream:
        prompt_open = (prompt_text or "").rstrip().endswith(ReasoningStream.START)
        return ReasoningStream(start_in_reasoning=self.name == "deepseek_r1" or prompt_open)

    def split(self, text: str, prompt_text: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole answer; None where a part is empty."""
        stream = self.new_stream(prompt_text)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        content = first.content + last.content
        return reasoning or None, content or None

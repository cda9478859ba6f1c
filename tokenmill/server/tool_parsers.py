"""Tool-call parsers: turn a model's text into OpenAI `tool_calls`, whole or while streaming.

Formats:
- hermes (also Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated.
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>`.
- required / named: what constrained decoding produces for tool_choice "required" (a JSON array
  of {"name", "parameters"}) and for a named function (the arguments object itself).

A malformed call (JSON that does not parse, no name, arguments that are not an object, or a
function that was not offered) is never an error: the text comes back as plain content, as
vLLM's parsers do for a whole answer. Streaming gives exactly the same result: content goes out
as it arrives until a call may begin; from there the text is held and, when the answer ends,
judged by the same `extract()` as a whole answer, so each valid call goes out complete, in one
delta (index, id, name and all its arguments), and a malformed one as content. Arguments do not
stream piece by piece: a stream cannot take back a call that turns out malformed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ParsedToolCall]


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def _call_from_object(obj: Any, offered: Collection[str] | None) -> ParsedToolCall | None:
    """{"name": str, "arguments"|"parameters": object or JSON text} -> a call, else None (also
    when `offered` is given and does not hold the name)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if offered is not None and obj["name"] not in offered:
        return None
    args: Any = {}
    for key in ("arguments", "parameters"):
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ToolParser:
    """Reads tool calls from a whole answer (`extract`) or a streamed one (`new_stream`)."""

    name = "base"

    def __init__(self, offered: Collection[str] | None = None) -> None:
        self.offered = offered  # the function names a call may use; None = any

    def extract(self, text: str) -> ExtractedToolCalls:  # pragma: no cover - interface
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where in the answer so far a call may begin: text before it is content for sure."""
        return 0

    def new_stream(self) -> ToolStreamParser:
        return ToolStreamParser(self)


class ToolStreamParser:
    """Per-choice streaming state. feed() returns what may be sent now; finish() the rest."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_calls = 0
        self._text = ""
        self._sent = 0  # characters of the answer already sent as content

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        hold = max(self.parser.hold_from(self._text), self._sent)
        out = StreamDelta(content=self._text[self._sent : hold])
        self._sent = hold
        return out

    def finish(self) -> StreamDelta:
        result = self.parser.extract(self._text)
        if not result.tool_calls:
            out = StreamDelta(content=self._text[self._sent :])
            self._sent = len(self._text)
            return out
        self.num_calls = len(result.tool_calls)
        return StreamDelta(tool_calls=[
            {"index": i, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(result.tool_calls)
        ])


# ------------------------------------------------------------------------------------ hermes


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.START)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        pos = start
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            try:
                obj, rest = _DECODER.raw_decode(body.strip())
            except json.JSONDecodeError:
                return ExtractedToolCalls(text, [])
            call = _call_from_object(obj, self.offered)
            if call is None or body.strip()[rest:].strip():
                return ExtractedToolCalls(text, [])
            calls.append(call)
            if end < 0:
                break
            pos = text.find(self.START, end + len(self.END))
        content = text[:start].strip() or None
        return ExtractedToolCalls(content, calls)

    def hold_from(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _partial_tag_suffix(text, self.START)


# -------------------------------------------------------------------------------- llama3 json


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        calls = _split_json_objects(body, self.offered)
        return ExtractedToolCalls(None, calls) if calls else ExtractedToolCalls(text, [])

    def hold_from(self, text: str) -> int:
        """The whole answer is calls or none is: held while it may still start like one."""
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.PYTHON_TAG)) or self.PYTHON_TAG.startswith(stripped):
            return 0
        return len(text)


def _split_json_objects(body: str, offered: Collection[str] | None) -> list[ParsedToolCall]:
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = _call_from_object(obj, offered)
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
    return calls


# ----------------------------------------------------------- forced choices (constrained)


class RequiredToolParser(ToolParser):
    """tool_choice "required": the answer is [{"name": ..., "parameters": {...}}, ...]."""

    name = "required"

    def extract(self, text: str) -> ExtractedToolCalls:
        """The complete calls, also from an array cut short by max_tokens; plain content when
        there is none."""
        body = text.strip()
        calls: list[ParsedToolCall] = []
        pos = 1 if body.startswith("[") else len(body)
        while pos < len(body):
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(body) or body[pos] == "]":
                break
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            call = _call_from_object(obj, self.offered)
            if call is None:
                break
            calls.append(call)
        return ExtractedToolCalls(None, calls) if calls else ExtractedToolCalls(text, [])


class NamedToolParser(ToolParser):
    """A named tool_choice: the answer is the arguments object of that one function."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(text, [])
        if not isinstance(args, dict):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, [ParsedToolCall(self.function_name, text.strip())])


# ---------------------------------------------------------------------------------- registry

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
}
TOOL_PARSER_CHOICES = ["auto", *TOOL_PARSERS]


def detect_tool_parser(chat_template: str | None) -> str:
    """The format a chat template teaches: hermes tags, Llama-3 JSON, else hermes (whose
    instructions the server adds to templates that do not render tools)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, chat_template: str | None = None, offered: Collection[str] | None = None) -> ToolParser:
    """The parser `name` (auto: from the chat template), taking calls to `offered` functions only."""
    if name == "auto":
        name = detect_tool_parser(chat_template)
    try:
        return TOOL_PARSERS[name](offered)
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; use one of {TOOL_PARSER_CHOICES}") from None

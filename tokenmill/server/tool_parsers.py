"""Tool-call parsers: turn a model's text into OpenAI `tool_calls`, whole or while streaming.

Formats:
- hermes (also Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated.
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>`.
- required / named: what constrained decoding produces for tool_choice "required" (a JSON array
  of {"name", "parameters"}) and for a named function (the arguments object itself).

A malformed call is never an error: the text comes back as plain content. While streaming, a
call's name goes out as soon as it is known and its arguments follow piece by piece; the pieces
of one call concatenate to valid JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_NAME_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_RE = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


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


def _call_from_object(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """{"name": str, "arguments"|"parameters": object or JSON text} -> a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arg_keys:
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


class _IncrementalCall:
    """Streams one JSON call object: the name once known, then raw argument text."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = make_tool_call_id()
        self.name_sent = False
        self.args_start: int | None = None
        self.streamed = ""

    def update(self, buf: str) -> list[dict[str, Any]]:
        """buf: the call's JSON text so far (always extended, never rewritten). The name goes
        out once the arguments are seen to open an object, so a call whose arguments are a
        string (or broken early) is sent whole by finish(), or given back as content."""
        out: list[dict[str, Any]] = []
        if not self.name_sent:
            match = _NAME_RE.match(buf)
            if match is None:
                return out
            args = _ARGS_RE.match(buf, match.end())
            if args is None or args.end() >= len(buf) or buf[args.end()] != "{":
                return out
            try:
                name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                return out
            out.append(self._header(name))
            self.name_sent = True
            self.args_start = args.end()
        assert self.args_start is not None
        region = buf[self.args_start :]
        # Hold back from the last "}" on: it may close the call object, not the arguments.
        cut = region.rfind("}")
        safe = region if cut < 0 else region[:cut]
        if len(safe) > len(self.streamed):
            out.append(self._args(safe[len(self.streamed) :]))
            self.streamed = safe
        return out

    def finish(self, obj_text: str) -> list[dict[str, Any]] | None:
        """The complete call text: the remaining fragments, or None when it is malformed."""
        body = obj_text.strip()
        try:
            obj, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return None
        if body[end:].strip():
            return None
        call = _call_from_object(obj)
        if call is None:
            return None
        if not self.name_sent:
            self.name_sent = True
            return [self._header(call.name, call.arguments)]
        raw = self._raw_arguments(obj_text)
        if raw is None:  # cannot happen once streaming started on an object; be safe anyway
            return [] if self.streamed else [self._args(call.arguments)]
        rest = raw[len(self.streamed) :] if raw.startswith(self.streamed) else ""
        return [self._args(rest)] if rest else []

    def _raw_arguments(self, obj_text: str) -> str | None:
        if self.args_start is None:
            return None
        try:
            value, end = _DECODER.raw_decode(obj_text, self.args_start)
        except json.JSONDecodeError:
            return None
        return obj_text[self.args_start : end] if isinstance(value, dict) else None

    def _header(self, name: str, arguments: str = "") -> dict[str, Any]:
        return {
            "index": self.index, "id": self.id, "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _args(self, piece: str) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": piece}}


class ToolStreamParser:
    """Per-choice streaming state. feed() returns what may be sent now; finish() the rest."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self) -> StreamDelta:  # pragma: no cover - interface
        raise NotImplementedError


class ToolParser:
    name = "base"

    def extract(self, text: str) -> ExtractedToolCalls:  # pragma: no cover - interface
        raise NotImplementedError

    def new_stream(self) -> ToolStreamParser:  # pragma: no cover - interface
        raise NotImplementedError


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
            call = _call_from_object(obj)
            if call is None or body.strip()[rest:].strip():
                return ExtractedToolCalls(text, [])
            calls.append(call)
            if end < 0:
                break
            pos = text.find(self.START, end + len(self.END))
        content = text[:start].strip() or None
        return ExtractedToolCalls(content, calls)

    def new_stream(self) -> ToolStreamParser:
        return _HermesStream()


class _HermesStream(ToolStreamParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._call: _IncrementalCall | None = None

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        out = StreamDelta()
        while True:
            if self._call is None:
                start = self._buf.find(HermesToolParser.START)
                if start < 0:
                    keep = _partial_tag_suffix(self._buf, HermesToolParser.START)
                    emit = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(emit) :]
                    if self.num_calls == 0 or emit.strip():
                        out.content += emit
                    return out
                before = self._buf[:start]
                if self.num_calls == 0 or before.strip():
                    out.content += before
                self._buf = self._buf[start + len(HermesToolParser.START) :]
                self._call = _IncrementalCall(self.num_calls)
                self._call_raw = ""
            end = self._buf.find(HermesToolParser.END)
            if end < 0:
                out.tool_calls += self._call.update(self._buf)
                return out
            body = self._buf[:end]
            out.extend(self._close(body, closed=True))
            self._buf = self._buf[end + len(HermesToolParser.END) :]

    def _close(self, body: str, closed: bool) -> StreamDelta:
        call, self._call = self._call, None
        assert call is not None
        pieces = call.update(body)
        rest = call.finish(body)
        if rest is None:
            # malformed: if nothing of it went out yet, it is plain content
            text = "" if call.name_sent else HermesToolParser.START + body
            if text and closed:
                text += HermesToolParser.END
            return StreamDelta(content=text, tool_calls=pieces)
        self.num_calls += 1
        return StreamDelta(tool_calls=pieces + rest)

    def finish(self) -> StreamDelta:
        if self._call is not None:
            body, self._buf = self._buf, ""
            return self._close(body, closed=False)
        text, self._buf = self._buf, ""
        return StreamDelta(content=text if (self.num_calls == 0 or text.strip()) else "")


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
        calls = _split_json_objects(body)
        return ExtractedToolCalls(None, calls) if calls else ExtractedToolCalls(text, [])

    def new_stream(self) -> ToolStreamParser:
        return _Llama3Stream()


def _split_json_objects(body: str) -> list[ParsedToolCall]:
    calls: list[ParsedToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = _call_from_object(obj)
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
    return calls


class _ObjectSequenceStream(ToolStreamParser):
    """Streams calls that are a sequence of JSON objects (optionally inside a JSON array)."""

    def __init__(self, in_array: bool) -> None:
        super().__init__()
        self._buf = ""
        self._pos = 0  # start of the current object in _buf
        self._in_array = in_array
        self._decided = False
        self._is_calls = False
        self._call: _IncrementalCall | None = None
        self._broken = False

    def _decide(self) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(Llama3JsonToolParser.PYTHON_TAG):
            stripped = stripped[len(Llama3JsonToolParser.PYTHON_TAG) :].lstrip()
        elif Llama3JsonToolParser.PYTHON_TAG.startswith(stripped) and stripped:
            return False
        if not stripped:
            return False
        opener = "[" if self._in_array else "{"
        self._is_calls = stripped.startswith(opener)
        if self._is_calls:
            self._pos = len(self._buf) - len(stripped) + (1 if self._in_array else 0)
        self._decided = True
        return True

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        if not self._decided and not self._decide():
            return StreamDelta()
        if not self._is_calls:
            out, self._buf = self._buf, ""
            return StreamDelta(content=out)
        return self._advance()

    def _advance(self) -> StreamDelta:
        out = StreamDelta()
        while not self._broken:
            while self._pos < len(self._buf) and self._buf[self._pos] in " \t\r\n;,]":
                self._pos += 1
            if self._pos >= len(self._buf):
                return out
            if self._buf[self._pos] != "{":
                self._broken = True
                return out
            if self._call is None:
                self._call = _IncrementalCall(self.num_calls)
            try:
                _, end = _DECODER.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                out.tool_calls += self._call.update(self._buf[self._pos :])
                return out
            body = self._buf[self._pos : end]
            out.tool_calls += self._call.update(body)
            rest = self._call.finish(body)
            if rest is None:
                self._broken = True
                return out
            out.tool_calls += rest
            self._call = None
            self.num_calls += 1
            self._pos = end
        return out

    def finish(self) -> StreamDelta:
        if not self._decided or not self._is_calls:
            text, self._buf = self._buf, ""
            return StreamDelta(content=text)
        out = self._advance()
        if self.num_calls == 0 and (self._call is None or not self._call.name_sent):
            out.content += self._buf  # never became a call: give the text back
        self._buf = ""
        return out


class _Llama3Stream(_ObjectSequenceStream):
    def __init__(self) -> None:
        super().__init__(in_array=False)


# ----------------------------------------------------------- forced choices (constrained)


class RequiredToolParser(ToolParser):
    """tool_choice "required": the answer is [{"name": ..., "parameters": {...}}, ...]."""

    name = "required"

    def extract(self, text: str) -> ExtractedToolCalls:
        """The complete calls, also from an array cut short by max_tokens (as streaming sends
        them); plain content when there is none."""
        stream = self.new_stream()
        delta = stream.feed(text)
        delta.extend(stream.finish())
        calls: dict[int, ParsedToolCall] = {}
        for frag in delta.tool_calls:
            function = frag["function"]
            if "id" in frag:
                calls[frag["index"]] = ParsedToolCall(function["name"], function["arguments"], frag["id"])
            else:
                calls[frag["index"]].arguments += function["arguments"]
        done = [calls[i] for i in range(stream.num_calls)]
        return ExtractedToolCalls(None, done) if done else ExtractedToolCalls(text, [])

    def new_stream(self) -> ToolStreamParser:
        return _ObjectSequenceStream(in_array=True)


class NamedToolParser(ToolParser):
    """A named tool_choice: the answer is the arguments object of that one function."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(text, [])
        if not isinstance(args, dict):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, [ParsedToolCall(self.function_name, text.strip())])

    def new_stream(self) -> ToolStreamParser:
        return _NamedStream(self.function_name)


class _NamedStream(ToolStreamParser):
    def __init__(self, function_name: str) -> None:
        super().__init__()
        self._call = _IncrementalCall(0)
        self._name = function_name

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        if not self._call.name_sent:
            self._call.name_sent = True
            self.num_calls = 1
            out.tool_calls.append(self._call._header(self._name))
        if text:
            out.tool_calls.append(self._call._args(text))
        return out

    def finish(self) -> StreamDelta:
        return self.feed("") if not self._call.name_sent else StreamDelta()


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


def get_tool_parser(name: str, chat_template: str | None = None) -> ToolParser:
    if name == "auto":
        name = detect_tool_parser(chat_template)
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; use one of {TOOL_PARSER_CHOICES}") from None

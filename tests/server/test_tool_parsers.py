"""Tool-call parsers on recorded model outputs: whole answers and every way of streaming them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    detect_tool_parser,
    get_tool_parser,
)

# Answers in the shape Qwen2.5-Instruct / Hermes-2-Pro produce them.
HERMES_OK = [
    (
        (
            '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
            '"unit": "fahrenheit"}}\n</tool_call>'
        ),
        None, [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})],
    ),
    (
        (
            "Let me check both cities.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2], "opts": {"metric": true}}}\n'
            "</tool_call>"
        ),
        "Let me check both cities.",
        [("get_weather", {"city": "Paris"}),
         ("get_weather", {"city": "Zürich", "days": [1, 2], "opts": {"metric": True}})],
    ),
    (  # arguments as a JSON string, and no arguments at all
        (
            '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"a}b\\"}"}\n</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>'
        ),
        None, [("search", {"q": "a}b"}), ("now", {})],
    ),
    (  # the answer stopped at EOS before the closing tag
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
        None, [("get_time", {"tz": "UTC"})],
    ),
    (  # arguments before the name
        '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", {"x": 1})],
    ),
]

HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # missing }
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not JSON
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {}} trailing words\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "argu',  # cut off mid-call
    "I would call a tool here: <tool_call>",
]

PLAIN = [
    "The capital of France is Paris.",
    "Use the <tool> tag or <tool_call_x> carefully.",
    "",
    "{not json at all",
]

# Answers in the shape Llama-3.1/3.2-Instruct produce them (JSON-based tool calling).
LLAMA_OK = [
    ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ('<|python_tag|>{"name": "brave_search", "parameters": {"query": "tokenmill"}}',
     [("brave_search", {"query": "tokenmill"})]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": {"z": [1, "}"]}}}',
     [("a", {"x": 1}), ("b", {"y": {"z": [1, "}"]}})]),
    ('\n\n{"name": "c", "arguments": {}}', [("c", {})]),
]

LLAMA_MALFORMED = [
    '{"name": "get_weather", "parameters": {"location": "Paris"}',  # truncated
    '{"answer": 42}',  # JSON, but not a call
    '{"name": "f", "parameters": {"a": 1}} and then some prose',
    '{"name": 5, "parameters": {}}',
]


def calls_of(result: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def run_stream(parser: ToolParser, text: str, sizes: list[int]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Feed text in pieces of the given sizes (cycled); rebuild content and calls as a client."""
    stream = parser.new_stream()
    content, calls = "", {}
    pos, i = 0, 0
    deltas = []
    while pos < len(text):
        size = sizes[i % len(sizes)] if sizes else len(text)
        deltas.append(stream.feed(text[pos : pos + size]))
        pos += size
        i += 1
    deltas.append(stream.finish())
    for delta in deltas:
        content += delta.content
        for frag in delta.tool_calls:
            call = calls.setdefault(frag["index"], {"name": None, "arguments": "", "id": None})
            if "id" in frag:
                assert call["id"] is None, "the id is sent once, with the name"
                call["id"] = frag["id"]
                call["name"] = frag["function"]["name"]
            assert call["name"] is not None, "arguments never arrive before the name"
            call["arguments"] += frag["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    parsed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    for i in calls:
        assert calls[i]["id"].startswith("call_")
    return content, parsed


@pytest.mark.parametrize("text,content,expected", HERMES_OK)
def test_hermes_extracts_calls(text: str, content: str | None, expected: list) -> None:
    result = HermesToolParser().extract(text)
    assert result.content == content
    assert calls_of(result) == expected


@pytest.mark.parametrize("text", HERMES_MALFORMED + PLAIN)
def test_hermes_malformed_is_plain_content(text: str) -> None:
    result = HermesToolParser().extract(text)
    assert result.tool_calls == []
    assert result.content == text


@pytest.mark.parametrize("text,expected", LLAMA_OK)
def test_llama3_extracts_calls(text: str, expected: list) -> None:
    result = Llama3JsonToolParser().extract(text)
    assert result.content is None
    assert calls_of(result) == expected


@pytest.mark.parametrize("text", LLAMA_MALFORMED + PLAIN)
def test_llama3_malformed_is_plain_content(text: str) -> None:
    result = Llama3JsonToolParser().extract(text)
    assert result.tool_calls == []
    assert result.content == text


CHUNKINGS = [[1], [2], [3, 1, 5], [7], [13, 2], []]


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text,content,expected", HERMES_OK)
def test_hermes_streaming_matches_whole(text: str, content: str | None, expected: list, sizes: list[int]) -> None:
    streamed_content, calls = run_stream(HermesToolParser(), text, sizes)
    assert calls == expected
    assert streamed_content.strip() == (content or "")


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text", HERMES_MALFORMED + PLAIN)
def test_hermes_streaming_malformed_is_content(text: str, sizes: list[int]) -> None:
    """Also a call that breaks only after its name and the opening of its arguments arrived:
    the stream held it, so it comes back as content, exactly as the whole answer does."""
    stream = HermesToolParser().new_stream()
    content, fragments = "", []
    for i in range(0, len(text), sizes[0] if sizes else max(len(text), 1)):
        delta = stream.feed(text[i : i + (sizes[0] if sizes else len(text))])
        content, fragments = content + delta.content, fragments + delta.tool_calls
    last = stream.finish()
    assert fragments + last.tool_calls == []
    assert content + last.content == text


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text,expected", LLAMA_OK)
def test_llama3_streaming_matches_whole(text: str, expected: list, sizes: list[int]) -> None:
    content, calls = run_stream(Llama3JsonToolParser(), text, sizes)
    assert calls == expected
    assert content.strip() == ""


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text", PLAIN + ['{"answer": 42}'])
def test_llama3_streaming_plain(text: str, sizes: list[int]) -> None:
    content, calls = run_stream(Llama3JsonToolParser(), text, sizes)
    assert calls == [] and content == text


def test_a_call_streams_whole_once_complete() -> None:
    """Content streams as it comes; a call goes out once, complete, in one delta per index."""
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    stream = HermesToolParser().new_stream()
    deltas = [stream.feed(ch) for ch in text]
    assert "".join(d.content for d in deltas) == "Checking."
    assert all(not d.tool_calls for d in deltas)
    calls = stream.finish().tool_calls
    assert [c["index"] for c in calls] == [0, 1] and stream.num_calls == 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "San Francisco"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


@pytest.mark.parametrize("parser", [HermesToolParser(offered={"get_time"}), Llama3JsonToolParser(offered={"get_time"})])
@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_a_function_not_offered_is_content(parser: ToolParser, sizes: list[int]) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<tool_call>{call}</tool_call>" if isinstance(parser, HermesToolParser) else call
    whole = parser.extract(text)
    assert whole.tool_calls == [] and whole.content == text
    assert run_stream(parser, text, sizes) == (text, [])
    offered = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    text = f"<tool_call>{offered}</tool_call>" if isinstance(parser, HermesToolParser) else offered
    assert calls_of(parser.extract(text)) == [("get_time", {"tz": "UTC"})]
    assert run_stream(parser, text, sizes)[1] == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("parser,text", [
    *[(HermesToolParser(), t) for t in [c[0] for c in HERMES_OK] + HERMES_MALFORMED + PLAIN],
    *[(Llama3JsonToolParser(), t) for t in [c[0] for c in LLAMA_OK] + LLAMA_MALFORMED + PLAIN],
    *[(RequiredToolParser(), t) for t in ['[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "par', "[1, 2", "oops"]],
    *[(NamedToolParser("f"), t) for t in ['{"city": "Paris"}', '{"city": "Par', "[1]"]],
])
def test_streamed_equals_whole(parser: ToolParser, text: str, sizes: list[int]) -> None:
    """Every parser, every answer (valid, malformed, cut short), every chunking: the same calls
    and the same content (up to the whitespace around the calls) streamed and whole."""
    whole = parser.extract(text)
    content, calls = run_stream(parser, text, sizes)
    assert calls == calls_of(whole)
    assert content.strip() == (whole.content or "").strip()


def test_required_and_named() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert calls_of(RequiredToolParser().extract(text)) == [("a", {"x": 1}), ("b", {})]
    for sizes in CHUNKINGS:
        assert run_stream(RequiredToolParser(), text, sizes)[1] == [("a", {"x": 1}), ("b", {})]
    assert RequiredToolParser().extract("[1, 2").tool_calls == []
    named = NamedToolParser("get_weather")
    assert calls_of(named.extract('{"city": "Paris"}')) == [("get_weather", {"city": "Paris"})]
    for sizes in CHUNKINGS:
        assert run_stream(named, '{"city": "Paris"}', sizes)[1] == [("get_weather", {"city": "Paris"})]


def test_parser_picked_from_chat_template() -> None:
    qwen = "{% for tool in tools %}...{% endfor %}<tool_call>\\n{\"name\": ...}</tool_call>"
    llama = "{%- if builtin_tools is defined %}<|python_tag|>{% endif %}ipython"
    assert detect_tool_parser(qwen) == "hermes"
    assert detect_tool_parser(llama) == "llama3_json"
    assert detect_tool_parser("{{ messages }}") == "hermes"
    assert detect_tool_parser(None) == "hermes"
    assert isinstance(get_tool_parser("auto", llama), Llama3JsonToolParser)
    with pytest.raises(ValueError):
        get_tool_parser("nope")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    prefix=st.text(alphabet=st.characters(blacklist_characters="<"), max_size=20),
    args=st.lists(st.dictionaries(st.text(max_size=6), _json_values, max_size=4), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    spaced=st.booleans(),
)
def test_hermes_streaming_property(prefix: str, args: list[dict], sizes: list[int], spaced: bool) -> None:
    """Any call sequence, cut anywhere: streamed pieces rebuild exactly what extract() finds."""
    sep = (", ", ": ") if spaced else (",", ":")
    body = "".join(
        f"<tool_call>\n{json.dumps({'name': f'fn_{i}', 'arguments': a}, separators=sep, ensure_ascii=False)}\n</tool_call>\n"
        for i, a in enumerate(args)
    )
    text = prefix + body
    whole = HermesToolParser().extract(text)
    expected = [(f"fn_{i}", a) for i, a in enumerate(args)]
    assert calls_of(whole) == expected
    content, calls = run_stream(HermesToolParser(), text, sizes)
    assert calls == expected
    assert content == prefix

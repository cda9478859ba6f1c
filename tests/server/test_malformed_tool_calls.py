"""Malformed tool calls through the real server (a scripted engine answers with recorded text,
served by uvicorn and read by the `openai` client): invalid JSON, arguments that are not JSON, a
function that was not offered. Streamed and not streamed, each comes back the same way: as plain
content with finish_reason "stop", and never as a call. A valid call is the control: a call both
ways, finish_reason "tool_calls"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from scripted_engine import AnswerEngine
from server_harness import RunningServer, start_server, start_server_on

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# (parser, answer, the call it holds when valid, else None)
CASES: list[tuple[str, str, tuple[str, dict[str, Any]] | None]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("get_weather", {"city": "Paris"})),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{city: Paris}"}\n</tool_call>', None),
    ("hermes", 'Checking.<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ("get_weather", {"city": "Paris"})),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}', None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": "city=Paris"}', None),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "UTC"}}', None),
]
IDS = ["hermes valid", "hermes invalid JSON", "hermes arguments not JSON", "hermes not offered",
       "llama3 valid", "llama3 invalid JSON", "llama3 arguments not an object", "llama3 not offered"]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[AnswerEngine, dict[str, RunningServer]]]:
    from tokenmill.models.loader import load_tokenizer, resolve_model

    engine = AnswerEngine(load_tokenizer(resolve_model(None)))
    hermes = start_server(engine, tool_call_parser="hermes")
    with start_server_on(hermes, tool_call_parser="llama3_json") as llama3:
        yield engine, {"hermes": hermes, "llama3_json": llama3}
    hermes.stop()


def _calls(tool_calls: list[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


@pytest.mark.parametrize("parser,answer,call", CASES, ids=IDS)
def test_a_tool_call_is_judged_the_same_streamed_and_not(servers: tuple[AnswerEngine, dict[str, RunningServer]],
                                                         parser: str, answer: str,
                                                         call: tuple[str, dict[str, Any]] | None) -> None:
    engine, by_parser = servers
    engine.answer = answer
    client = by_parser[parser].client()
    request = {"model": "scripted", "messages": ASK, "tools": [WEATHER]}
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_content = "".join(d.content or "" for d in deltas)
    streamed_calls = _calls([t for d in deltas for t in d.tool_calls or []])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if call is None:
        assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (answer, [], "stop")
        assert (streamed_content, streamed_calls, finish) == (answer, [], ["stop"])
    else:
        assert _calls(whole.message.tool_calls) == streamed_calls == [call]
        assert whole.finish_reason == "tool_calls" and finish == ["tool_calls"]
        assert not whole.message.content and not streamed_content.strip()

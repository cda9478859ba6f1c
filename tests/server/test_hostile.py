"""Hostile clients against the real server (SmolLM2, in-process): lone surrogates in every string
field, deep nesting, huge bodies and headers, wrong types, extreme numbers, booleans as strings.
No answer is a 5xx, none hangs, each refusal names what is wrong, and afterwards the server is
healthy and answers a normal request correctly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

TIMEOUT = httpx.Timeout(30)  # a hang fails the test instead of stalling CI
LONE = "\ud83d"  # half of 😀, as a JavaScript client sends it after slicing a string
MSG = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "the city"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **fields}


def with_tool(**function: Any) -> dict[str, Any]:
    return chat(tools=[{"type": "function", "function": {**TOOL["function"], **function}}])


# (endpoint, body with a lone surrogate in one string field, the field's path in the error)
SURROGATE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": f"Hi {LONE}"}]), "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", chat(messages=[{"role": "system", "content": "Be brief.", "name": LONE}, *MSG]),
     "messages.0.name"),
    ("/v1/chat/completions", chat(messages=[*HISTORY[:1], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
     "function": {"name": "get_weather", "arguments": '{"city": "' + LONE + '"}'}}]}, HISTORY[2]]),
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", chat(messages=[*HISTORY[:2], {**HISTORY[2], "tool_call_id": LONE}]),
     "messages.2.tool_call_id"),
    ("/v1/chat/completions", with_tool(description=LONE), "tools.0.function.description"),
    ("/v1/chat/completions", with_tool(name=f"get{LONE}"), "tools.0.function.name"),
    ("/v1/chat/completions", with_tool(parameters={"type": "object", "properties": {
        "city": {"type": "string", "description": LONE}}}), "tools.0.function.parameters.properties.city.description"),
    ("/v1/chat/completions", with_tool(parameters={"type": "object", "properties": {LONE: {"type": "string"}}}),
     "tools.0.function.parameters.properties (a key)"),
    ("/v1/chat/completions", chat(cache_salt=LONE), "cache_salt"),
    ("/v1/chat/completions", chat(model=LONE), "model"),
    ("/v1/chat/completions", chat(stop=LONE), "stop"),
    ("/v1/chat/completions", chat(stop=["ok", LONE]), "stop.1"),
    ("/v1/chat/completions", chat(user=LONE), "user"),
    ("/v1/chat/completions", chat(guided_choice=["yes", LONE]), "guided_choice.1"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"enum": [LONE]}}}}}),
     "response_format.json_schema.schema.properties.a.enum.0"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"flag": LONE}), "chat_template_kwargs.flag"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x\udc00y"}]), "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ude00\ud83d"}]), "messages.0.content"),
    ("/v1/completions", {"prompt": f"Once {LONE}", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", LONE], "max_tokens": 2}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "cache_salt": LONE}, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": LONE}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": [LONE]}, "stop.0"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "x", "model": LONE}, "model"),
    ("/detokenize", {"tokens": [1, 2], "model": LONE}, "model"),
]

DEEP = 5000
OTHER_CASES: list[tuple[str, str, str | dict[str, Any], int]] = [
    # (name, endpoint, body, status)
    ("deeply nested body", "/v1/chat/completions", "[" * DEEP + "]" * DEEP, 400),
    ("deeply nested content", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": ' + "[" * DEEP + "]" * DEEP + "}]}", 400),
    ("deeply nested template kwargs", "/v1/chat/completions",
     json.dumps(chat())[:-1] + ', "chat_template_kwargs": {"a": ' + "[" * 900 + "]" * 900 + "}}", 400),
    ("deeply nested tool schema", "/v1/chat/completions", with_tool(parameters={"type": "object", "properties": {
        "a": json.loads('{"type": "array", "items": ' * 400 + '{"type": "string"}' + "}" * 400)}}), 400),
    ("deeply nested response schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads('{"type": "array", "items": ' * 400 + '{"type": "string"}' + "}" * 400)}}), 400),
    ("deeply nested guided_json text", "/v1/chat/completions", chat(guided_json="[" * DEEP + "]" * DEEP), 400),
    ("messages is a number", "/v1/chat/completions", {"messages": 5}, 400),
    ("content is an object", "/v1/chat/completions", chat(messages=[{"role": "user", "content": {"a": 1}}]), 400),
    ("max_tokens is text", "/v1/chat/completions", chat(max_tokens="5 tokens"), 400),
    ("temperature is a list", "/v1/chat/completions", chat(temperature=[1]), 400),
    ("n is fractional", "/v1/chat/completions", chat(n=1.5), 400),
    ("stop is a number", "/v1/chat/completions", chat(stop=5), 400),
    ("tools is text", "/v1/chat/completions", chat(tools="get_weather"), 400),
    ("tool_choice is a number", "/v1/chat/completions", chat(tools=[TOOL], tool_choice=5), 400),
    ("prompt is an object", "/v1/completions", {"prompt": {"text": "x"}}, 400),
    ("tokens are text", "/detokenize", {"tokens": ["a"]}, 400),
    ("stream 'yes'", "/v1/chat/completions", chat(stream="yes"), 400),
    ("stream 'true'", "/v1/chat/completions", chat(stream="true"), 400),
    ("stream 1", "/v1/chat/completions", chat(stream=1), 400),
    ("logprobs 'true'", "/v1/chat/completions", chat(logprobs="true"), 400),
    ("ignore_eos 'false'", "/v1/chat/completions", chat(ignore_eos="false"), 400),
    ("include_usage 'yes'", "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}), 400),
    ("echo 'no'", "/v1/completions", {"prompt": "x", "max_tokens": 2, "echo": "no"}, 400),
    ("add_special_tokens 'off'", "/tokenize", {"prompt": "x", "add_special_tokens": "off"}, 400),
    ("max_tokens 1e308", "/v1/chat/completions", chat(max_tokens=1e308), 400),
    ("max_tokens 10**30", "/v1/chat/completions", chat(max_tokens=10**30), 400),
    ("max_tokens -10**30", "/v1/chat/completions", chat(max_tokens=-(10**30)), 400),
    ("max_tokens 1e400 (infinity)", "/v1/chat/completions", json.dumps(chat())[:-1] + ', "max_tokens": 1e400}', 400),
    ("temperature -1e308", "/v1/chat/completions", chat(temperature=-1e308), 400),
    ("temperature NaN", "/v1/chat/completions", json.dumps(chat())[:-1] + ', "temperature": NaN}', 400),
    ("n 10**9", "/v1/chat/completions", chat(n=10**9), 400),
    ("top_logprobs 10**9", "/v1/chat/completions", chat(logprobs=True, top_logprobs=10**9), 400),
    ("min_tokens 10**20", "/v1/chat/completions", chat(min_tokens=10**20), 400),
    ("stop_token_ids 2**70", "/v1/chat/completions", chat(stop_token_ids=[2**70]), 400),
    ("prompt token 2**64", "/v1/completions", {"prompt": [2**64], "max_tokens": 2}, 400),
    ("detokenize 2**63", "/detokenize", {"tokens": [2**63]}, 400),
    ("seed 10**40", "/v1/chat/completions", chat(seed=10**40), 200),
    ("seed -10**40", "/v1/chat/completions", chat(seed=-(10**40)), 200),
    ("priority 10**30", "/v1/chat/completions", chat(priority=10**30), 200),
    ("top_k 10**30", "/v1/chat/completions", chat(top_k=10**30), 200),
    ("a surrogate pair, escaped", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi 😀"}]), 200),
]


def _post(server: Any, path: str, body: bytes | str | dict[str, Any], **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)  # ensure_ascii: surrogates become \ud83d escapes
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json",
                      **kwargs.pop("headers", {})}, timeout=TIMEOUT, **kwargs)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert len(resp.content) < 4096, "an error never echoes more than a short prefix of the request"
    return error


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES, ids=[c[2] + " " + c[0] for c in SURROGATE_CASES])
def test_lone_surrogates_are_refused_naming_the_field(server: Any, path: str, body: dict[str, Any], field: str) -> None:
    error = _error(_post(server, path, body), 400)
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: the text is not valid Unicode")


def raw_utf8(body: dict[str, Any]) -> bytes:
    """The body with every character as raw bytes, not escaped: a lone surrogate becomes its three
    bytes (`ED A0 BD`), as a client that encodes with `surrogatepass` (or in CESU-8) sends it."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES, ids=[c[2] + " " + c[0] for c in SURROGATE_CASES])
def test_lone_surrogates_as_raw_bytes_are_refused_naming_the_field(server: Any, path: str, body: dict[str, Any],
                                                                   field: str) -> None:
    raw = raw_utf8(body)
    assert b"\\u" not in raw and b"\xed" in raw
    error = _error(_post(server, path, raw), 400)
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: the text is not valid Unicode")


RAW_CASES: list[tuple[str, bytes, int, str]] = [
    # (name, body, status, start of the error message)
    ("a whole character, raw", raw_utf8(chat(messages=[{"role": "user", "content": "Hi 😀 é"}])), 200, ""),
    ("a UTF-8 BOM", b"\xef\xbb\xbf" + raw_utf8(chat()), 200, ""),
    ("a pair in CESU-8", raw_utf8(chat(messages=[{"role": "user", "content": "Hi \ud83d\ude00"}])), 400,
     "messages.0.content: the text is not valid Unicode"),
    ("a byte that never starts UTF-8", json.dumps(chat()).encode().replace(b"Hi", b"H\xff"), 400,
     "The request body is not valid UTF-8: byte 0xff at offset"),
    ("latin-1 text", json.dumps(chat()).encode().replace(b"Hi", "café".encode("latin-1")), 400,
     "The request body is not valid UTF-8: byte 0xe9 at offset"),
    ("a truncated sequence", json.dumps(chat()).encode().replace(b"Hi", b"H\xe2\x82"), 400,
     "The request body is not valid UTF-8: byte 0xe2 at offset"),
    ("an overlong NUL", json.dumps(chat()).encode().replace(b"Hi", b"H\xc0\x80"), 400,
     "The request body is not valid UTF-8: byte 0xc0 at offset"),
    ("UTF-16", json.dumps(chat()).encode("utf-16"), 400, "The request body is not valid UTF-8"),
]


@pytest.mark.parametrize("name,body,status,message", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_bytes(server: Any, name: str, body: bytes, status: int, message: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = _post(server, path, body)
        if status == 200:
            assert resp.status_code == 200, resp.text[:500]
        else:
            assert _error(resp, status)["message"].startswith(message)


@pytest.mark.parametrize("name,path,body,status", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_hostile_bodies(server: Any, name: str, path: str, body: str | dict[str, Any], status: int) -> None:
    resp = _post(server, path, body)
    if status == 200:
        assert resp.status_code == 200, resp.text[:500]
    else:
        _error(resp, status)


def test_the_engine_side_takes_any_str(server: Any) -> None:
    """Behind the edge, too: a lone surrogate as cache_salt is hashed and served (it once stopped
    the engine thread), and as a prompt it is a 400-type refusal, not a crash."""
    import asyncio

    from tokenmill.errors import InvalidRequestError
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.server.engine_client import ChildRequest

    engine = server.state.engine

    async def run() -> int:
        with pytest.raises(InvalidRequestError, match="not valid Unicode"):
            await engine.submit("bad-prompt", [ChildRequest(f"x{LONE}", SamplingParams(max_tokens=1))])
        stream = await engine.submit("salted", [ChildRequest(list(range(1, 40)), SamplingParams(
            max_tokens=2, ignore_eos=True))], cache_salt=LONE)
        return sum([len(output.outputs[0].token_ids) async for _, output in stream])

    assert asyncio.run(run()) == 2
    assert engine.is_running


def test_a_huge_model_name_is_not_echoed(server: Any) -> None:
    error = _error(_post(server, "/v1/chat/completions", chat(model="m" * 5_000_000)), 404)
    assert "(5000000 characters)" in error["message"]
    error = _error(httpx.get(f"{server.base_url}/models/%ED%A0%BD" + "x" * 3000, timeout=TIMEOUT), 404)
    assert error["param"] == "model"


def test_huge_bodies_get_413(server: Any) -> None:
    from server_harness import MAX_REQUEST_BYTES

    big = json.dumps({"messages": [{"role": "user", "content": "a" * (MAX_REQUEST_BYTES + 1)}]})
    assert "--max-request-bytes" in _error(_post(server, "/v1/chat/completions", big), 413)["message"]

    def chunks() -> Any:  # no Content-Length: counted while it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_REQUEST_BYTES // 2**16 + 2):
            yield b"a" * 2**16
        yield b'"}]}'

    resp = httpx.post(f"{server.base_url}/chat/completions", content=chunks(),
                      headers={"content-type": "application/json"}, timeout=TIMEOUT)
    _error(resp, 413)


@pytest.mark.parametrize("headers", [{"x-big": "a" * 40_000}, {f"x-h{i}": "v" * 200 for i in range(300)},
                                     {"x-big": "a" * 400_000}], ids=["one big header", "many headers", "past a read"])
def test_huge_headers_get_431(server: Any, headers: dict[str, str]) -> None:
    resp = httpx.post(f"{server.base_url}/chat/completions", json=chat(), headers=headers, timeout=TIMEOUT)
    assert "--max-header-bytes" in _error(resp, 431)["message"]


def test_bearer_scheme_is_case_insensitive(server: Any) -> None:
    from server_harness import start_server_on

    with start_server_on(server, api_key="sekret") as guarded:
        for scheme in ("Bearer", "bearer", "BEARER"):
            resp = httpx.get(f"{guarded.base_url}/models", headers={"Authorization": f"{scheme} sekret"}, timeout=TIMEOUT)
            assert resp.status_code == 200, scheme
        for value in ("Basic sekret", "bearer wrong", "sekret", "bearer"):
            _error(httpx.get(f"{guarded.base_url}/models", headers={"Authorization": value}, timeout=TIMEOUT), 401)


def test_completions_report_cached_tokens(server: Any) -> None:
    client = server.client()
    prompt = "The history of the Roman Empire, told in one long sentence: " * 4  # several full blocks
    first = client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=1)
    streamed = list(client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=1, stream=True,
                                              stream_options={"include_usage": True}))
    block = server.engine.config.cache.block_size
    cached = (first.usage.prompt_tokens - 1) // block * block  # full blocks, one token left to compute
    assert again.usage.prompt_tokens_details.cached_tokens == cached > 0
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_a_streamed_tool_call_arrives_whole_in_one_delta(server: Any) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"]}}}
    chunks = list(server.client().chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "What time is it in Paris?"}],
        tools=[tool], tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60,
        temperature=0, stream=True))
    with_calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(with_calls) == 1
    (call,) = with_calls[0].choices[0].delta.tool_calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["timezone"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_healthy_and_correct_after_all_that(server: Any) -> None:
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    answer = server.client().chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    stats = server.engine_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)

"""Bad input gets a 4xx with an OpenAI-style error body, never a 5xx, and the server keeps going."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Hi"}]
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "nonsense"}}}}}
OK_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **fields}


CHAT_CASES: list[tuple[str, Any, int]] = [
    ("malformed JSON", '{"messages": [', 400),
    ("body is not an object", "[1, 2, 3]", 400),
    ("NaN is not a number", '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    ("messages is a string", {"messages": "hi"}, 400),
    ("max_tokens is text", chat(max_tokens="lots"), 400),
    ("temperature is text", chat(temperature="hot"), 400),
    ("negative max_tokens", chat(max_tokens=-5), 400),
    ("zero max_tokens", chat(max_tokens=0), 400),
    ("unknown model", chat(model="gpt-17"), 404),
    ("no messages", {"messages": []}, 400),
    ("messages missing", {"max_tokens": 2}, 400),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("user message without content", {"messages": [{"role": "user"}]}, 400),
    ("image content part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400),
    ("prompt longer than the context", {"messages": [{"role": "user", "content": "word " * 9000}]}, 400),
    ("max_tokens beyond the context", chat(max_tokens=10**6), 400),
    ("invalid tool schema", chat(tools=[BAD_TOOL]), 400),
    ("tool parameters not an object schema", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), 400),
    ("duplicate tool names", chat(tools=[OK_TOOL, OK_TOOL]), 400),
    ("named tool that does not exist", chat(tools=[OK_TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400),
    ("required without tools", chat(tool_choice="required"), 400),
    ("bad tool_choice string", chat(tools=[OK_TOOL], tool_choice="sometimes"), 400),
    ("invalid response schema", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400),
    ("json_schema without schema", chat(response_format={"type": "json_schema"}), 400),
    ("unknown response_format", chat(response_format={"type": "yaml"}), 400),
    ("invalid regex", chat(guided_regex="(unclosed"), 400),
    ("top_logprobs without logprobs", chat(top_logprobs=3), 400),
    ("too many top_logprobs", chat(logprobs=True, top_logprobs=99), 400),
    ("n = 0", chat(n=0), 400),
    ("top_p = 0", chat(top_p=0), 400),
    ("negative temperature", chat(temperature=-1), 400),
    ("presence_penalty out of range", chat(presence_penalty=5), 400),
    ("min_tokens above max_tokens", chat(min_tokens=5), 400),
    ("seed of the wrong type", chat(seed="lucky"), 400),
    ("empty guided_choice", chat(guided_choice=[]), 400),
    ("stop_token_ids outside the vocabulary", chat(stop_token_ids=[10**9]), 400),
    ("logit_bias", chat(logit_bias={"5": 10}), 400),
    ("template kwargs of the wrong type", chat(chat_template_kwargs="x"), 400),
    ("a request chat template without the server flag", chat(chat_template="{{ messages }}"), 400),
]

COMPLETION_CASES: list[tuple[str, Any, int]] = [
    ("empty prompt", {"prompt": ""}, 400),
    ("empty token list", {"prompt": []}, 400),
    ("token ids outside the vocabulary", {"prompt": [1, 2, 10**7]}, 400),
    ("negative token id", {"prompt": [-1]}, 400),
    ("prompt of the wrong type", {"prompt": {"text": "x"}}, 400),
    ("logprobs too many", {"prompt": "x", "logprobs": 50}, 400),
    ("best_of other than n", {"prompt": "x", "best_of": 3}, 400),
    ("suffix", {"prompt": "x", "suffix": "y"}, 400),
    ("prompt longer than the context", {"prompt": list(range(1, 9000))}, 400),
    ("unknown model", {"prompt": "x", "model": "nope"}, 404),
    ("too many sequences", {"prompt": ["x"] * 100, "n": 20}, 400),
]

OTHER_CASES: list[tuple[str, str, str, Any, int]] = [
    ("GET on a POST route", "GET", "/v1/chat/completions", None, 405),
    ("unknown route", "POST", "/v1/nothing", {}, 404),
    ("tokenize without input", "POST", "/tokenize", {}, 400),
    ("tokenize with no messages", "POST", "/tokenize", {"messages": []}, 400),
    ("detokenize outside the vocabulary", "POST", "/detokenize", {"tokens": [10**8]}, 400),
    ("detokenize wrong type", "POST", "/detokenize", {"tokens": "abc"}, 400),
]


def _post(server: Any, path: str, body: Any, method: str = "POST") -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.request(method, f"{server.url}{path}", content=None if body is None else content,
                         headers={"content-type": "application/json"}, timeout=120)


def _check_error(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status


@pytest.mark.parametrize("name,body,status", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_bad_input(server: Any, name: str, body: Any, status: int) -> None:
    _check_error(_post(server, "/v1/chat/completions", body), status)


@pytest.mark.parametrize("name,body,status", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completions_bad_input(server: Any, name: str, body: Any, status: int) -> None:
    _check_error(_post(server, "/v1/completions", {"max_tokens": 2, **body}), status)


@pytest.mark.parametrize("name,method,path,body,status", OTHER_CASES, ids=[c[0] for c in OTHER_CASES])
def test_other_bad_input(server: Any, name: str, method: str, path: str, body: Any, status: int) -> None:
    _check_error(_post(server, path, body, method), status)


def test_request_chat_template_that_raises(server: Any) -> None:
    from server_harness import start_server_on

    with start_server_on(server, trust_request_chat_template=True) as trusting:
        resp = _post(trusting, "/v1/chat/completions", chat(chat_template="{{ raise_exception('no') }}"))
        _check_error(resp, 400)
        assert "no" in resp.json()["error"]["message"]
        ok = _post(trusting, "/v1/chat/completions", chat(
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}\n", max_tokens=1))
        assert ok.status_code == 200, ok.text


def test_stream_request_errors_before_the_stream(server: Any) -> None:
    """A streamed request that is refused gets a plain 4xx, not a 200 stream with an error."""
    resp = _post(server, "/v1/chat/completions", chat(stream=True, max_tokens=-1))
    _check_error(resp, 400)
    resp = _post(server, "/v1/chat/completions", {**chat(stream=True), "messages": [
        {"role": "user", "content": "word " * 9000}]})
    _check_error(resp, 400)


def test_sdk_raises_typed_errors(server: Any) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.state.model_name, messages=MSG, max_tokens=-3)
    assert "max_tokens" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing-model", messages=MSG, max_tokens=2)


def test_still_healthy_after_bad_input(server: Any) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = server.client().chat.completions.create(model=server.state.model_name, messages=MSG, max_tokens=2)
    assert resp.choices[0].finish_reason in ("stop", "length")

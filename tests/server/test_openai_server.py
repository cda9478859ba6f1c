"""The real server on the real SmolLM2 engine, driven by the real `openai` client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def expected_prompt_ids(server: Any, messages: list[dict[str, Any]]) -> list[int]:
    tok = server.state.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_models(server: Any, client: Any) -> None:
    models = client.models.list().data
    assert len(models) == 1
    card = models[0].model_dump()
    assert card["id"] == server.state.model_name
    assert card["root"].endswith(".gguf")
    assert card["max_model_len"] == server.engine.config.model.max_model_len
    assert client.models.retrieve(server.state.model_name).id == server.state.model_name
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_non_streamed(server: Any, client: Any) -> None:
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    prompt_ids = expected_prompt_ids(server, QUESTION)
    extra = resp.model_extra
    assert extra["prompt_token_ids"] == prompt_ids
    token_ids = choice.model_extra["token_ids"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(token_ids)
    assert resp.usage.total_tokens == len(prompt_ids) + len(token_ids)
    assert token_ids[-1] == server.state.tokenizer.eos_token_id
    assert server.state.tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content


def test_chat_streamed_matches_non_streamed(server: Any, client: Any) -> None:
    whole = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True},
    )
    chunks = list(client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    ))
    first = chunks[0]
    # No role-only chunk: the first one carries the role and the first token's text together.
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content
    assert first.model_extra["prompt_token_ids"] == expected_prompt_ids(server, QUESTION)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert content == whole.choices[0].message.content
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == len(ids)
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_wire_format(server: Any) -> None:
    body = {"model": server.state.model_name, "messages": QUESTION, "max_tokens": 4, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


def test_completions_streamed_and_not(server: Any, client: Any) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=6,
                                      temperature=0, echo=True)
    assert whole.choices[0].text.startswith(prompt)
    ids = server.state.tokenizer.encode(prompt)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == 6
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert prompt + text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    by_ids = client.completions.create(model=server.state.model_name, prompt=ids, max_tokens=6, temperature=0)
    assert prompt + by_ids.choices[0].text == whole.choices[0].text
    batch = client.completions.create(model=server.state.model_name, prompt=[prompt, "Hello"], max_tokens=2,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_ids.choices[0].text[: len(batch.choices[0].text)]


def test_n_samples(server: Any, client: Any) -> None:
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=8, temperature=1.0, n=2, seed=7,
        extra_body={"return_token_ids": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)
    chunks = list(client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=8, temperature=1.0, n=2, seed=7,
        stream=True,
    ))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in resp.choices}


def test_logprobs(server: Any, client: Any) -> None:
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    for entry in entries[:-1]:  # (the last one may be the EOS token, which has no text)
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(values[0])
    assert "".join(e.token for e in entries[:-1]) in resp.choices[0].message.content + " "
    chunks = list(client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, stream=True,
    ))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    comp = client.completions.create(model=server.state.model_name, prompt="The capital of France is",
                                     max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_strings(server: Any, client: Any) -> None:
    resp = client.completions.create(model=server.state.model_name, prompt="The capital of France is",
                                     max_tokens=10, temperature=0, stop=[" Paris"])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" not in choice.text
    assert choice.model_extra["stop_reason"] == " Paris"
    chunks = list(client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=16, temperature=0, stop=["France"],
        stream=True,
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "France" not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(server: Any, client: Any) -> None:
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model=server.state.model_name, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12, temperature=1.0, seed=seed,
        )
        return resp.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2))


def test_multi_turn_with_tool_results(server: Any, client: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    rendered = server.state.renderer.render(_messages(messages), tools=None)
    assert '"city": "Paris"' in rendered and '{"temp_c": 21}' in rendered
    resp = client.chat.completions.create(model=server.state.model_name, messages=messages, max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length")


def _messages(raw: list[dict[str, Any]]) -> list[Any]:
    from pydantic import TypeAdapter

    from tokenmill.server.protocol import ChatMessage

    return TypeAdapter(list[ChatMessage]).validate_python(raw)


def test_tokenize_detokenize(server: Any) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == server.state.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == server.state.max_model_len
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION})
    assert r.json()["tokens"] == expected_prompt_ids(server, QUESTION)


def test_metrics(server: Any, client: Any) -> None:
    client.completions.create(model=server.state.model_name, prompt="Hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("tokenmill:request_success_total", "tokenmill:time_to_first_token_seconds_count",
                 "tokenmill:inter_token_latency_seconds_count", "tokenmill:e2e_request_latency_seconds_count",
                 "tokenmill:num_requests_running", "tokenmill:num_requests_waiting",
                 "tokenmill:kv_cache_blocks_used", "tokenmill:prefix_cache_hit_rate",
                 "tokenmill:num_preemptions_total", "tokenmill:prompt_tokens_total",
                 "tokenmill:generation_tokens_total"):
        assert name in text, name
    line = next(row for row in text.splitlines()
                if row.startswith("tokenmill:request_success_total") and 'finished_reason="length"' in row)
    assert float(line.split()[-1]) >= 1


# ------------------------------------------------------------------ tools and structured output

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 16}}, "required": ["timezone"]}},
}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(server: Any, client: Any, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": server.state.model_name, "messages": TOOL_MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80, "temperature": 0,
    }
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments, c.id) for c in choice.message.tool_calls]
    else:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        acc: dict[int, dict[str, str]] = {}
        for chunk in chunks:
            for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = acc.setdefault(delta_call.index, {"name": "", "arguments": "", "id": ""})
                if delta_call.id:
                    entry["id"] = delta_call.id
                if delta_call.function and delta_call.function.name:
                    entry["name"] = delta_call.function.name
                if delta_call.function and delta_call.function.arguments:
                    entry["arguments"] += delta_call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = [(e["name"], e["arguments"], e["id"]) for _, e in sorted(acc.items())]
    assert calls
    for name, arguments, call_id in calls:
        assert call_id.startswith("call_")
        _check_call(name, arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(server: Any, client: Any, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": server.state.model_name, "messages": TOOL_MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 60,
        "temperature": 0,
    }
    if not stream:
        call = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
        name, arguments = call.function.name, call.function.arguments
    else:
        name, arguments = "", ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = name or (d.function.name or "")
                arguments += d.function.arguments or ""
    assert name == "get_time"
    _check_call(name, arguments)


def test_tool_choice_auto_plain_answer(server: Any, client: Any) -> None:
    resp = client.chat.completions.create(model=server.state.model_name, messages=QUESTION,
                                          tools=[WEATHER_TOOL], max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason != "tool_calls":
        assert choice.message.content and not choice.message.tool_calls


def test_json_schema_response(server: Any, client: Any) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 1000}},
              "required": ["capital", "population_millions"]}
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_a_grammar_over_the_limit_is_refused_before_compiling(server: Any, client: Any) -> None:
    """A schema past --max-grammar-bytes is a 400 naming the flag (compiling one takes time that grows
    steeply with its size); one under it is served."""
    import openai

    limit = server.state.max_grammar_bytes
    properties = {f"field_{i}": {"type": "string"} for i in range(limit // 24)}
    schema = {"type": "object", "properties": properties}
    assert len(json.dumps(schema)) > limit
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.state.model_name, messages=QUESTION, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
    assert "--max-grammar-bytes" in str(caught.value)
    small = {"type": "object", "properties": dict(list(properties.items())[:8])}
    resp = client.chat.completions.create(
        model=server.state.model_name, messages=QUESTION, max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "small", "schema": small}})
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_reasoning_parser(server: Any) -> None:
    """A second app on the same engine thread, with --reasoning-parser deepseek_r1."""
    from server_harness import start_server_on

    with start_server_on(server, reasoning_parser="deepseek_r1") as other:
        client = other.client()
        resp = client.chat.completions.create(model=server.state.model_name, messages=QUESTION, max_tokens=6,
                                              temperature=0)
        msg = resp.choices[0].message
        assert msg.model_extra["reasoning_content"] and msg.content is None  # no </think>: all thought
        chunks = list(client.chat.completions.create(model=server.state.model_name, messages=QUESTION,
                                                     max_tokens=6, temperature=0, stream=True))
        streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
        assert streamed == msg.model_extra["reasoning_content"]

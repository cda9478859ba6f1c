"""POST /v1/chat/completions: render, submit, then stream chunks or build one response."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputSpec
from tokenmill.server.access_log import record_usage
from tokenmill.server.chat import (
    check_tools,
    named_tool,
    parameters_schema,
    required_tools_schema,
)
from tokenmill.server.engine_client import ChildRequest, RequestStream
from tokenmill.server.metrics import speculative_usage
from tokenmill.server.protocol import ChatCompletionRequest, NamedToolChoice
from tokenmill.server.reasoning import ReasoningStream
from tokenmill.server.serving import (
    SSE_DONE,
    ServerState,
    asks_structured,
    build_sampling_params,
    chat_logprobs,
    new_request_id,
    sse,
    sse_with_disconnect,
    stream_error_event,
    structured_from_request,
    unless_disconnected,
)
from tokenmill.server.steering import refusal_of, strengths_of
from tokenmill.server.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    StreamDelta,
    ToolParser,
    ToolStreamParser,
    get_tool_parser,
)


@dataclass
class _Plan:
    """What one chat request needs beyond its sampling parameters."""

    request_id: str
    model: str
    prompt_text: str
    prompt_ids: list[int]
    tool_parser: ToolParser | None
    top_logprobs: int | None  # None: no logprobs
    steering: dict[str, float] = field(default_factory=dict)  # the request's strengths
    created: int = field(default_factory=lambda: int(time.time()))


def _tool_setup(state: ServerState, req: ChatCompletionRequest) -> tuple[ToolParser | None, StructuredOutputSpec | None]:
    tools, choice = req.tools or [], req.tool_choice
    if tools:
        check_tools(tools)
    if isinstance(choice, NamedToolChoice):
        if not tools:
            raise InvalidRequestError("tool_choice names a function but no tools were given")
        tool = named_tool(tools, choice)
        return NamedToolParser(tool.function.name), StructuredOutputSpec(
            "json_schema", json.dumps(parameters_schema(tool)))
    if choice == "required":
        if not tools:
            raise InvalidRequestError('tool_choice "required" needs tools')
        schema = required_tools_schema(tools, parallel=req.parallel_tool_calls is not False)
        return RequiredToolParser(), StructuredOutputSpec("json_schema", json.dumps(schema))
    if tools and choice != "none":
        return get_tool_parser(state.tool_parser, offered={tool.function.name for tool in tools}), None
    return None, None


def _structured_setup(state: ServerState, req: ChatCompletionRequest
                      ) -> tuple[ToolParser | None, StructuredOutputSpec | None]:
    tool_parser, tool_structured = _tool_setup(state, req)
    return tool_parser, state.compile_structured(tool_structured or structured_from_request(req))


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Any:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    if state.renderer is None:
        raise InvalidRequestError("this model has no tokenizer; use /v1/completions with token ids")
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise InvalidRequestError(
            "chat_template in a request is refused; start the server with --trust-request-chat-template")
    strengths = strengths_of(state, req)
    tool_parser, structured = None, None
    if req.tools or req.tool_choice is not None or asks_structured(req):  # tool schemas too: off the loop
        tool_parser, structured = await asyncio.to_thread(_structured_setup, state, req)
    tools_for_prompt = req.tools if req.tools and req.tool_choice != "none" else None
    prompt_text = await state.run(
        raw, state.renderer.render, req.messages, tools=tools_for_prompt, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs, template=req.chat_template,
    )
    prompt_ids = await state.run(raw, state.prompts.encode, prompt_text, add_special_tokens=False,
                                 max_tokens=state.max_model_len - 1)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(
        state, req, max_tokens=req.max_completion_tokens or req.max_tokens,
        prompt_len=len(prompt_ids), logprobs=top, structured=structured,
    )
    n = req.n or 1
    plan = _Plan(new_request_id("chatcmpl"), model, prompt_text, prompt_ids, tool_parser, top, strengths)
    children = [ChildRequest(prompt_ids, params.for_child(i)) for i in range(n)]
    stream = await state.engine.submit(plan.request_id, children, priority=req.priority, cache_salt=req.cache_salt,
                                       timeout=state.time_left(arrival), steering=strengths or None)
    if state.request_log is not None:
        state.request_log.watch(stream, model, children)
    if req.stream:
        events = _stream_events(state, req, plan, stream, n, raw.scope)
        return StreamingResponse(
            sse_with_disconnect(raw, stream, events), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await unless_disconnected(raw, stream, _full_response(state, req, plan, stream, n))
    record_usage(raw.scope, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    return JSONResponse(body)


@dataclass
class _Choice:
    index: int
    reasoning: ReasoningStream | None
    tools: ToolStreamParser | None
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_tokens: int = 0
    started: bool = False
    tool_called: bool = False
    spec: Any = None  # the latest (cumulative) SpecUsage, None without speculative decoding
    text: str = ""  # the whole answer so far (kept only for the refusal detector)


def _parse_delta(choice: _Choice, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
    """(reasoning, content, tool-call fragments) that may be sent now."""
    reasoning, content = "", text
    if choice.reasoning is not None:
        part = choice.reasoning.feed(text)
        reasoning, content = part.reasoning, part.content
        if final:
            last = choice.reasoning.finish()
            reasoning, content = reasoning + last.reasoning, content + last.content
    calls: list[dict[str, Any]] = []
    if choice.tools is not None:
        delta = choice.tools.feed(content) if content else StreamDelta()
        if final:
            delta.extend(choice.tools.finish())
        content, calls = delta.content, delta.tool_calls
        choice.tool_called = choice.tool_called or choice.tools.num_calls > 0 or bool(calls)
    return reasoning, content, calls


async def _stream_events(
    state: ServerState, req: ChatCompletionRequest, plan: _Plan, stream: RequestStream, n: int, scope: dict[str, Any],
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    choices = [
        _Choice(i, state.reasoning.new_stream(plan.prompt_text) if state.reasoning else None,
                plan.tool_parser.new_stream() if plan.tool_parser else None)
        for i in range(n)
    ]
    base = {"id": plan.request_id, "object": "chat.completion.chunk", "created": plan.created, "model": plan.model}
    sent_prompt_ids = False
    cached = 0
    try:
        async for index, output in stream:
            choice = choices[index]
            cached = max(cached, output.num_cached_tokens)
            completion = output.outputs[0]
            if output.spec is not None:
                choice.spec = output.spec
            choice.pending_ids += completion.token_ids
            choice.num_tokens += len(completion.token_ids)
            if completion.logprobs:
                choice.pending_logprobs += completion.logprobs
            if state.detector is not None:
                choice.text += completion.text
            reasoning, content, calls = _parse_delta(choice, completion.text, output.finished)
            if not (reasoning or content or calls or output.finished):
                continue  # nothing visible yet: the ids ride with the next chunk
            delta: dict[str, Any] = {}
            if not choice.started:
                delta["role"] = "assistant"
                choice.started = True
                if not (reasoning or calls):
                    delta["content"] = content
            if content:
                delta["content"] = content
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = calls
            item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            if plan.top_logprobs is not None and choice.pending_ids:
                item["logprobs"] = {"content": chat_logprobs(
                    state, choice.pending_ids, choice.pending_logprobs, plan.top_logprobs)}
            if output.finished:
                item["finish_reason"] = _finish_reason(completion.finish_reason, choice.tool_called)
                item["stop_reason"] = completion.stop_reason
                refusal = refusal_of(state, choice.text, output.direction_projections, plan.steering)
                if refusal is not None:
                    item["refusal"] = refusal
            if req.return_token_ids:
                item["token_ids"] = choice.pending_ids
            choice.pending_ids, choice.pending_logprobs = [], []
            chunk = {**base, "choices": [item]}
            if req.return_token_ids and not sent_prompt_ids:
                chunk["prompt_token_ids"] = plan.prompt_ids
                sent_prompt_ids = True
            if continuous:
                chunk["usage"] = _usage(plan, choices, cached)
            yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(plan, choices, cached)})
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 - the request failed midway: say so in-band
        yield stream_error_event(exc)
        yield SSE_DONE
    finally:
        record_usage(scope, len(plan.prompt_ids), sum(c.num_tokens for c in choices))


def _finish_reason(engine_reason: str | None, tool_called: bool) -> str | None:
    """"tool_calls" when the answer ended by itself with calls; a cut-off answer stays "length"."""
    return "tool_calls" if tool_called and engine_reason == "stop" else engine_reason


def _usage(plan: _Plan, choices: list[_Choice], cached: int) -> dict[str, Any]:
    completion = sum(c.num_tokens for c in choices)
    usage: dict[str, Any] = {
        "prompt_tokens": len(plan.prompt_ids), "completion_tokens": completion,
        "total_tokens": len(plan.prompt_ids) + completion,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    speculative = speculative_usage(c.spec for c in choices)
    if speculative is not None:
        usage["speculative"] = speculative
    return usage


async def _full_response(
    state: ServerState, req: ChatCompletionRequest, plan: _Plan, stream: RequestStream, n: int
) -> dict[str, Any]:
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
    finish: list[Any] = [None] * n
    stop_reason: list[Any] = [None] * n
    specs: list[Any] = [None] * n
    projections: list[Any] = [None] * n
    cached = 0
    async for index, output in stream:
        completion = output.outputs[0]
        cached = max(cached, output.num_cached_tokens)
        if output.spec is not None:
            specs[index] = output.spec
        texts[index] += completion.text
        ids[index] += completion.token_ids
        logprobs[index] += completion.logprobs or []
        if output.finished:
            finish[index], stop_reason[index] = completion.finish_reason, completion.stop_reason
            projections[index] = output.direction_projections
    choices = []
    for i in range(n):
        reasoning: str | None = None
        content: str | None = texts[i]
        if state.reasoning is not None:
            reasoning, content = state.reasoning.split(texts[i], plan.prompt_text)
        tool_calls: list[dict[str, Any]] = []
        if plan.tool_parser is not None and content:
            extracted = plan.tool_parser.extract(content)
            content = extracted.content
            tool_calls = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in extracted.tool_calls
            ]
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": content if (content or not tool_calls) else None,
                        "reasoning_content": reasoning, "tool_calls": tool_calls},
            "logprobs": None,
            "finish_reason": _finish_reason(finish[i], bool(tool_calls)),
            "stop_reason": stop_reason[i],
        }
        if plan.top_logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(state, ids[i], logprobs[i], plan.top_logprobs)}
        if req.return_token_ids:
            choice["token_ids"] = ids[i]
        refusal = refusal_of(state, texts[i], projections[i], plan.steering)
        if refusal is not None:
            choice["refusal"] = refusal
        choices.append(choice)
    completion_tokens = sum(len(x) for x in ids)
    usage: dict[str, Any] = {
        "prompt_tokens": len(plan.prompt_ids), "completion_tokens": completion_tokens,
        "total_tokens": len(plan.prompt_ids) + completion_tokens,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    speculative = speculative_usage(specs)
    if speculative is not None:
        usage["speculative"] = speculative
    body: dict[str, Any] = {
        "id": plan.request_id, "object": "chat.completion", "created": plan.created,
        "model": plan.model, "choices": choices, "usage": usage,
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = plan.prompt_ids
    return body

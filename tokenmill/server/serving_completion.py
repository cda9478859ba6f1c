"""POST /v1/completions: text or token-id prompts (one or a batch), n samples each, echo."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.errors import InvalidRequestError
from tokenmill.server.access_log import record_usage
from tokenmill.server.engine_client import ChildRequest, RequestStream
from tokenmill.server.metrics import speculative_usage
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving import (
    SSE_DONE,
    ServerState,
    asks_structured,
    build_sampling_params,
    completion_logprobs,
    new_request_id,
    room_for_answer,
    sse,
    sse_with_disconnect,
    stream_error_event,
    structured_from_request,
    unless_disconnected,
)
from tokenmill.server.steering import refusal_of, strengths_of

MAX_PROMPTS = 256
MAX_SEQUENCES = 1024  # prompts x n in one request


@dataclass
class _Prompt:
    ids: list[int]
    text: str


@dataclass
class _Plan:
    request_id: str
    model: str
    prompts: list[_Prompt]
    n: int
    steering: dict[str, float] = field(default_factory=dict)  # the request's strengths
    created: int = field(default_factory=lambda: int(time.time()))


async def _prompts(state: ServerState, req: CompletionRequest, raw: Request) -> list[_Prompt]:
    given = req.prompt
    if isinstance(given, str):
        items: list[str | list[int]] = [given]
    elif given and all(isinstance(x, int) for x in given):
        items = [list(given)]  # type: ignore[arg-type]
    else:
        items = list(given)  # type: ignore[arg-type]
    if len(items) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request")
    prompts = []
    for item in items:
        if not item:
            raise InvalidRequestError("the prompt is empty")
        if isinstance(item, str):
            if state.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids")
            ids = await state.run(raw, state.prompts.encode, item, add_special_tokens=req.add_special_tokens,
                                  max_tokens=state.max_model_len - 1)
            prompts.append(_Prompt(ids, item))
        else:
            room_for_answer(state, len(item), None)  # too long: refused before any work on it
            await state.run(raw, state.check_token_ids, item, "the prompt")
            text = await state.run(raw, state.prompts.decode, item) if req.echo and state.tokenizer else ""
            prompts.append(_Prompt(list(item), text))
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Any:
    arrival = time.monotonic()
    model = state.check_model(req.model)
    strengths = strengths_of(state, req)
    structured = None
    if asks_structured(req):
        structured = await asyncio.to_thread(lambda: state.compile_structured(structured_from_request(req)))
    prompts = await _prompts(state, req, raw)
    n = req.n or 1
    if len(prompts) * n > MAX_SEQUENCES:
        raise InvalidRequestError(f"prompts x n may be at most {MAX_SEQUENCES}, got {len(prompts) * n}")
    children = []
    for prompt in prompts:
        params = build_sampling_params(
            state, req, max_tokens=16 if req.max_tokens is None else req.max_tokens,
            prompt_len=len(prompt.ids), logprobs=req.logprobs, structured=structured,
        )
        children += [ChildRequest(prompt.ids, params.for_child(i)) for i in range(n)]
    plan = _Plan(new_request_id("cmpl"), model, prompts, n, strengths)
    stream = await state.engine.submit(plan.request_id, children, priority=req.priority, cache_salt=req.cache_salt,
                                       timeout=state.time_left(arrival), steering=strengths or None)
    if state.request_log is not None:
        state.request_log.watch(stream, model, children)
    if req.stream:
        return StreamingResponse(
            sse_with_disconnect(raw, stream, _stream_events(state, req, plan, stream, raw.scope)),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    body = await unless_disconnected(raw, stream, _full_response(state, req, plan, stream))
    record_usage(raw.scope, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    return JSONResponse(body)


@dataclass
class _Choice:
    prompt: _Prompt
    started: bool = False
    offset: int = 0
    num_tokens: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[Any] = field(default_factory=list)
    spec: Any = None  # the latest (cumulative) SpecUsage, None without speculative decoding
    cached: int = 0  # prompt tokens found in the prefix cache
    text: str = ""  # the generated text so far (kept only for the refusal detector)


def _echo(req: CompletionRequest, choice: _Choice) -> tuple[str, list[int], list[Any]]:
    """The echoed prompt text and, for logprobs, its tokens (which have no log-probabilities)."""
    if not req.echo:
        return "", [], []
    return choice.prompt.text, list(choice.prompt.ids), [None] * len(choice.prompt.ids)


def _usage(plan: _Plan, choices: list[_Choice]) -> dict[str, Any]:
    prompt = sum(len(p.ids) for p in plan.prompts)
    completion = sum(c.num_tokens for c in choices)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    # prompt_tokens counts each prompt once, so cached tokens do too: the most any of its n samples found
    cached = sum(max(c.cached for c in choices[i : i + plan.n]) for i in range(0, len(choices), plan.n))
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    speculative = speculative_usage(c.spec for c in choices)
    if speculative is not None:
        usage["speculative"] = speculative
    return usage


async def _stream_events(
    state: ServerState, req: CompletionRequest, plan: _Plan, stream: RequestStream, scope: dict[str, Any],
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    choices = [_Choice(p) for p in plan.prompts for _ in range(plan.n)]
    base = {"id": plan.request_id, "object": "text_completion", "created": plan.created, "model": plan.model}
    try:
        async for index, output in stream:
            choice = choices[index]
            completion = output.outputs[0]
            choice.cached = max(choice.cached, output.num_cached_tokens)
            if output.spec is not None:
                choice.spec = output.spec
            choice.pending_ids += completion.token_ids
            choice.num_tokens += len(completion.token_ids)
            if req.logprobs is not None:
                choice.pending_logprobs += completion.logprobs or [{}] * len(completion.token_ids)
            text = completion.text
            if state.detector is not None:
                choice.text += text
            if not (text or output.finished):
                continue  # nothing visible yet: the ids ride with the next chunk
            first = not choice.started
            choice.started = True
            item: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
            ids, rows = choice.pending_ids, choice.pending_logprobs
            if first:
                echo_text, echo_ids, echo_rows = _echo(req, choice)
                item["text"] = echo_text + text
                ids, rows = echo_ids + ids, echo_rows + rows
            if req.logprobs is not None:
                item["logprobs"], choice.offset = completion_logprobs(
                    state, ids, rows, req.logprobs, choice.offset)
            if output.finished:
                item["finish_reason"] = completion.finish_reason
                item["stop_reason"] = completion.stop_reason
                refusal = refusal_of(state, choice.text, output.direction_projections, plan.steering)
                if refusal is not None:
                    item["refusal"] = refusal
            if req.return_token_ids:
                item["token_ids"] = choice.pending_ids
                if first:
                    item["prompt_token_ids"] = choice.prompt.ids
            choice.pending_ids, choice.pending_logprobs = [], []
            chunk = {**base, "choices": [item]}
            if continuous:
                chunk["usage"] = _usage(plan, choices)
            yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": _usage(plan, choices)})
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 - the request failed midway: say so in-band
        yield stream_error_event(exc)
        yield SSE_DONE
    finally:
        record_usage(scope, sum(len(p.ids) for p in plan.prompts), sum(c.num_tokens for c in choices))


async def _full_response(state: ServerState, req: CompletionRequest, plan: _Plan, stream: RequestStream) -> dict[str, Any]:
    choices = [_Choice(p) for p in plan.prompts for _ in range(plan.n)]
    texts = [""] * len(choices)
    ids: list[list[int]] = [[] for _ in choices]
    rows: list[list[Any]] = [[] for _ in choices]
    finish: list[Any] = [None] * len(choices)
    stop_reason: list[Any] = [None] * len(choices)
    projections: list[Any] = [None] * len(choices)
    async for index, output in stream:
        completion = output.outputs[0]
        choices[index].cached = max(choices[index].cached, output.num_cached_tokens)
        if output.spec is not None:
            choices[index].spec = output.spec
        texts[index] += completion.text
        ids[index] += completion.token_ids
        choices[index].num_tokens += len(completion.token_ids)
        if req.logprobs is not None:
            rows[index] += completion.logprobs or [{}] * len(completion.token_ids)
        if output.finished:
            finish[index], stop_reason[index] = completion.finish_reason, completion.stop_reason
            projections[index] = output.direction_projections
    out = []
    for index, choice in enumerate(choices):
        echo_text, echo_ids, echo_rows = _echo(req, choice)
        item: dict[str, Any] = {
            "index": index, "text": echo_text + texts[index], "logprobs": None,
            "finish_reason": finish[index], "stop_reason": stop_reason[index],
        }
        if req.logprobs is not None:
            item["logprobs"], _ = completion_logprobs(
                state, echo_ids + ids[index], echo_rows + rows[index], req.logprobs, 0)
        if req.return_token_ids:
            item["prompt_token_ids"] = choice.prompt.ids
            item["token_ids"] = ids[index]
        refusal = refusal_of(state, texts[index], projections[index], plan.steering)
        if refusal is not None:
            item["refusal"] = refusal
        out.append(item)
    return {
        "id": plan.request_id, "object": "text_completion", "created": plan.created,
        "model": plan.model, "choices": out, "usage": _usage(plan, choices),
    }

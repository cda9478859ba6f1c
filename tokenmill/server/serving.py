"""What chat and completions share: the server's state, errors, sampling parameters built from a
request, log-probability formatting, and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import Request

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams, StructuredOutputSpec
from tokenmill.server.chat import ChatRenderer, check_json_schema
from tokenmill.server.engine_client import ERROR_STATUS, EngineClient, RequestStream, RequestTimeoutError, SteeringInfo
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.prompt_tokenizer import PromptTokenizer
from tokenmill.server.protocol import _SamplingFields
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.request_log import RequestLog
from tokenmill.server.validation import clip
from tokenmill.steering.detector import RefusalDetector

T = TypeVar("T")
SEED_MODULUS = 2**62  # any int64 seed maps into what torch generators take, with room for +n
MAX_ERROR_MESSAGE = 2000  # characters; messages quote client text only through clip()


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, *, type: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
    431: "invalid_request_error", 500: "server_error", 503: "service_unavailable", 504: "timeout_error",
}


def error_body(message: str, status: int, *, type: str | None = None, param: str | None = None) -> dict[str, Any]:
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + "..."
    return {"error": {"message": clip(message, MAX_ERROR_MESSAGE + 3),
                      "type": type or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else clip(param), "code": status}}


def status_of(exc: BaseException) -> int:
    """The HTTP status that answers an exception a request ended with."""
    if isinstance(exc, InvalidRequestError):
        return 400
    if isinstance(exc, APIError):
        return exc.status
    return next((status for kind, status in ERROR_STATUS.items() if isinstance(exc, kind)), 500)


def stream_error_event(exc: BaseException) -> str:
    """The last `data:` event of a stream that ended with `exc` (the caller sends [DONE] after)."""
    status = status_of(exc)
    known = status != 500 or any(isinstance(exc, kind) for kind in ERROR_STATUS)
    message = str(exc) if known else f"internal server error ({type(exc).__name__}); see the server log"
    return sse(error_body(message, status))


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: Any
    model_names: list[str]
    model_root: str
    max_model_len: int
    vocab_size: int
    renderer: ChatRenderer | None
    tool_parser: str  # resolved name: hermes or llama3_json
    reasoning: ReasoningParser | None
    metrics: ServerMetrics
    prompts: PromptTokenizer  # tokenization and templating, off the event loop
    api_key: str | None = None
    trust_request_chat_template: bool = False
    request_log: RequestLog | None = None
    request_timeout: float | None = None  # seconds from arrival; None = no deadline
    max_grammar_bytes: int = 32 * 2**10  # a structured-output grammar's source; compile time grows steeply past it
    steering: SteeringInfo | None = None  # the served steering file (None: requests may not steer)
    detector: RefusalDetector | None = None  # None: no `refusal` objects, no detector metrics
    _token_strs: dict[int, str] = field(default_factory=dict)
    _grammars: Any = None  # a StructuredOutputManager, made on first use
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        if model is None or model == "" or model in self.model_names:
            return self.model_name
        raise APIError(f"The model `{clip(model)}` does not exist.", 404, param="model")

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._token_strs[token_id] = text
        return text

    def check_token_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    async def run(self, raw: Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the tokenizer pool, in the lane of `raw`'s body size."""
        body_bytes = len(await raw.body())  # read (and kept) before the request model was built
        return await self.prompts.run(fn, *args, body_bytes=body_bytes, **kwargs)

    def time_left(self, arrival: float) -> float | None:
        """Seconds left of --request-timeout for a request that arrived at `arrival` (monotonic)."""
        if self.request_timeout is None:
            return None
        left = self.request_timeout - (time.monotonic() - arrival)
        if left <= 0:
            raise RequestTimeoutError(f"the request did not start within --request-timeout ({self.request_timeout:g} s)")
        return left

    def compile_structured(self, spec: StructuredOutputSpec | None) -> StructuredOutputSpec | None:
        """The spec with its grammar compiled, so that a bad grammar is a 400 before the engine sees
        it and the engine thread (which every stream waits on) never compiles one. Blocking, for
        seconds on a large schema: call it on a worker thread (see `asks_structured`)."""
        if spec is None:
            return None
        size = len((spec.value or "").encode("utf-8", "surrogatepass"))
        if size > self.max_grammar_bytes:
            raise InvalidRequestError(f"the structured-output grammar is {size} bytes; this server compiles at most "
                                      f"{self.max_grammar_bytes} (--max-grammar-bytes)")
        with self._grammars_lock:
            if self._grammars is None:
                from tokenmill.engine.structured_output import StructuredOutputManager

                self._grammars = StructuredOutputManager(self.tokenizer, self.vocab_size)
        return replace(spec, compiled=self._grammars.compile(spec))


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def room_for_answer(state: ServerState, prompt_len: int, max_tokens: int | None) -> int:
    """The max_tokens to run with; InvalidRequestError when prompt + answer cannot fit."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty")
    room = state.max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {state.max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input."
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise InvalidRequestError(
            f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
            f"{state.max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {state.max_model_len} - {prompt_len})."
        )
    return max_tokens


def asks_structured(req: _SamplingFields) -> bool:
    """Whether structured_from_request has work to do. That work (checking a JSON schema with
    jsonschema, compiling its grammar with xgrammar) takes seconds for a large schema, so callers
    run it on a worker thread: on the event loop it would hold up every request and /health."""
    return any(field is not None for field in (
        req.response_format, req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar))


def structured_from_request(req: _SamplingFields) -> StructuredOutputSpec | None:
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputSpec("json_object")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema")
        schema = fmt.json_schema.json_schema
        check_json_schema(schema, "response_format.json_schema.schema")
        return StructuredOutputSpec("json_schema", json.dumps(schema))
    if req.guided_json is not None:
        guided: Any = req.guided_json
        if isinstance(guided, str):
            try:
                guided = json.loads(guided)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequestError(f"guided_json is not valid JSON: {type(exc).__name__}: {clip(str(exc))}") from exc
        check_json_schema(guided, "guided_json")
        return StructuredOutputSpec("json_schema", json.dumps(guided))
    if req.guided_regex is not None:
        return StructuredOutputSpec("regex", req.guided_regex)
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise InvalidRequestError("guided_choice must not be empty")
        return StructuredOutputSpec("regex", "(" + "|".join(_regex_escape(c) for c in req.guided_choice) + ")")
    if req.guided_grammar is not None:
        return StructuredOutputSpec("grammar", req.guided_grammar)
    return None


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/-" else ch for ch in text)


def build_sampling_params(
    state: ServerState, req: _SamplingFields, *, max_tokens: int | None, prompt_len: int,
    logprobs: int | None, structured: StructuredOutputSpec | None,
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = list(req.stop_token_ids or [])
    state.check_token_ids(stop_ids, "stop_token_ids")
    top_k = req.top_k or 0
    return SamplingParams(
        n=1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=min(max(top_k, 0), state.vocab_size),
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=None if req.seed is None else req.seed % SEED_MODULUS,
        max_tokens=room_for_answer(state, prompt_len, max_tokens),
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured_output=structured,
    )


def finite(value: float) -> float:
    """JSON cannot carry -inf/NaN; OpenAI clients expect a number."""
    if math.isnan(value):
        return -9999.0
    return max(float(value), -9999.0)


def _sampled_logprob(row: dict[int, float], token_id: int) -> float:
    if token_id in row:
        return finite(row[token_id])
    return finite(next(iter(row.values()))) if row else -9999.0


def chat_logprobs(state: ServerState, token_ids: list[int], rows: list[dict[int, float]], top: int) -> list[dict[str, Any]]:
    entries = []
    for token_id, row in zip(token_ids, rows):
        text = state.token_str(token_id)
        best = sorted(row.items(), key=lambda kv: -kv[1])[:top] if top else []
        entries.append({
            "token": text, "logprob": _sampled_logprob(row, token_id),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := state.token_str(t)), "logprob": finite(lp), "bytes": list(s.encode("utf-8"))}
                for t, lp in best
            ],
        })
    return entries


def completion_logprobs(
    state: ServerState, token_ids: list[int], rows: list[dict[int, float] | None], top: int, offset: int,
) -> tuple[dict[str, Any], int]:
    """(the OpenAI completions logprobs block, the text offset after these tokens)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, row in zip(token_ids, rows):
        text = state.token_str(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if not row:  # an echoed prompt token: no log-probability
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_sampled_logprob(row, token_id))
        best = sorted(row.items(), key=lambda kv: -kv[1])[:top]
        out["top_logprobs"].append({state.token_str(t): finite(lp) for t, lp in best})
    return out, offset


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has closed the connection (its body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, stream: RequestStream, work: Awaitable[T]) -> T:
    """Runs `work`; if the client leaves first, aborts the request and raises."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        stream.abort()


async def sse_with_disconnect(request: Request, stream: RequestStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Forwards server-sent events; a client that leaves has its request aborted at once."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    watcher.add_done_callback(lambda t: None if t.cancelled() else stream.abort())
    try:
        async for event in events:
            yield event
    finally:
        watcher.cancel()
        stream.abort()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"

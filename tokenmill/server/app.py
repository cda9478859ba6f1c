"""The FastAPI application: routes, OpenAI-style errors, API-key check, and server state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.errors import InvalidRequestError
from tokenmill.server.access_log import AccessLogMiddleware
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.chat import ChatRenderer, load_chat_template
from tokenmill.server.engine_client import ERROR_STATUS, EngineBusyError, EngineClient, SteppableEngine
from tokenmill.server.http_limits import BodyLimitMiddleware, HeaderLimitMiddleware
from tokenmill.server.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.server.prompt_tokenizer import PromptTokenizer
from tokenmill.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UserMessage,
)
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.request_log import RequestLog
from tokenmill.server.serving import (
    APIError,
    ClientDisconnected,
    ServerState,
    error_body,
    status_of,
)
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.steering import make_detector
from tokenmill.server.tool_parsers import detect_tool_parser, get_tool_parser
from tokenmill.server.validation import NotUtf8, clip, decode_body, find_lone_surrogate

logger = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def default_tokenizer_workers() -> int:
    """One core is left to the event loop (and the engine thread): tokenizing on every core
    starves the loop that answers /health."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores - 1))


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "The request body is over --max-request-bytes"},
    429: {"model": ErrorResponse, "description": "The waiting queue is full (Retry-After says when to retry)"},
    503: {"model": ErrorResponse, "description": "The engine is not running, or the server is shutting down"},
    504: {"model": ErrorResponse, "description": "The request ran past --request-timeout"},
}


def _stream_doc(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "string", "description": f"with stream=true: `data: <{model.__name__}>` events, "
        "then `data: [DONE]`; a request that fails midway ends with `data: {\"error\": {...}}` "
        "then `data: [DONE]`"}}}}, **_ERRORS}


def state_for_engine(engine: SteppableEngine, *, max_waiting_requests: int | None = None, **options: Any) -> ServerState:
    """The usual composition: an AsyncEngine (the engine client) around a loaded LLMEngine,
    feeding the server's metrics. `options` are create_state's."""
    names = options.get("served_model_names") or [engine.model_name]
    metrics = ServerMetrics(names[0])
    client = AsyncEngine(engine, metrics, max_waiting_requests=max_waiting_requests)
    return create_state(client, metrics=metrics, **options)


def create_state(
    engine: EngineClient, *, metrics: ServerMetrics, served_model_names: list[str] | None = None,
    chat_template: str | None = None, tool_call_parser: str = "auto", reasoning_parser: str | None = None,
    api_key: str | None = None, trust_request_chat_template: bool = False, request_log_dir: str | None = None,
    request_timeout: float | None = None, tokenizer_workers: int | None = None, refusal_detector: str = "auto",
) -> ServerState:
    """Server state over an engine client; `metrics` must be the sink the client reports to."""
    info = engine.model_info
    tokenizer = info.tokenizer
    renderer = ChatRenderer(tokenizer, load_chat_template(chat_template)) if tokenizer is not None else None
    template = renderer.chat_template if renderer is not None else None
    parser_name = detect_tool_parser(template) if tool_call_parser == "auto" else tool_call_parser
    get_tool_parser(parser_name)  # fail at start-up on an unknown name
    if renderer is not None:
        with contextlib.suppress(Exception):  # compiles the template now, not in the first request
            renderer.render([UserMessage(role="user", content="Hi")])
    return ServerState(
        engine=engine, tokenizer=tokenizer, model_names=list(served_model_names or [info.name]),
        model_root=info.root, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        renderer=renderer, tool_parser=parser_name,
        reasoning=ReasoningParser(reasoning_parser) if reasoning_parser else None,
        metrics=metrics, prompts=PromptTokenizer(tokenizer, tokenizer_workers or default_tokenizer_workers()),
        api_key=api_key,
        trust_request_chat_template=trust_request_chat_template,
        request_log=RequestLog(request_log_dir) if request_log_dir else None, request_timeout=request_timeout,
        steering=info.steering, detector=make_detector(refusal_detector, info.steering),
    )


class _ApiKeyMiddleware:
    """Bearer-token check for the API routes (health, metrics and docs stay open). The scheme is
    case-insensitive (RFC 7235): `bearer KEY` works as `Bearer KEY` does."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.expected):
                response = JSONResponse(error_body("Unauthorized: a valid API key is required", 401), 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CheckedRoute(APIRoute):
    """Parses a JSON body on the worker pool (a large body then never holds up the event loop),
    and refuses one with a lone surrogate in any string, naming the field, before the request
    model is validated (pydantic would accept it; a tokenizer or a hash would not)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if request.method == "POST" and body:
                state: ServerState = request.app.state.tokenmill
                try:
                    value = await state.prompts.run(_parse_json, body, body_bytes=len(body))
                except NotUtf8 as error:
                    raise APIError(str(error), 400) from None
                except (ValueError, RecursionError):
                    pass  # FastAPI parses it again and answers the malformed body itself
                else:
                    request._json = value  # Starlette's cache of request.json(), which FastAPI reads
                    if isinstance(value, _LoneSurrogate):
                        raise APIError(f"{value.where}: the text is not valid Unicode (a lone UTF-16 surrogate at "
                                       f"character {value.index}; send whole characters, or escape both halves of "
                                       "a pair)", 400, param=value.where)
            return await handler(request)

        return checked


class _LoneSurrogate:
    def __init__(self, where: str, index: int) -> None:
        self.where, self.index = where, index


def _parse_json(body: bytes) -> Any:
    try:
        return pydantic_core.from_json(body)  # a few times faster; its strings are Rust strings, never a surrogate
    except ValueError:
        pass  # lone surrogates (escaped or as raw bytes), bytes that are not UTF-8, NaN, deep nesting, bad JSON
    value = json.loads(decode_body(body))  # raises NotUtf8 or a JSONDecodeError
    found = find_lone_surrogate(value)
    return value if found is None else _LoneSurrogate(*found)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        loc = ".".join(clip(str(x), 32) for x in err.get("loc", ()) if x != "body")
        first = first or loc or None
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", first


def _serve_exact_openapi(app: FastAPI, state: ServerState) -> None:
    """The served schema states this server's real limits (token ids below the vocabulary size)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()

            def visit(node: Any) -> None:
                if isinstance(node, dict):
                    if node.pop("x-token-id", False):
                        node["maximum"] = state.vocab_size - 1
                    for value in node.values():
                        visit(value)
                elif isinstance(node, list):
                    for value in node:
                        visit(value)

            visit(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(state: ServerState, *, shutdown_engine: bool = True, max_request_bytes: int | None = None,
              max_header_bytes: int | None = None, access_log: bool = False) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            await asyncio.to_thread(state.engine.shutdown)
            state.prompts.shutdown()

    app = FastAPI(
        title="tokenmill", version=tokenmill.__version__, lifespan=lifespan,
        description="OpenAI-compatible LLM server",
    )
    app.router.route_class = _CheckedRoute
    app.state.tokenmill = state
    _serve_exact_openapi(app, state)
    if state.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.api_key)
    if max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if max_header_bytes is not None:
        app.add_middleware(HeaderLimitMiddleware, max_bytes=max_header_bytes)
    if access_log:
        app.add_middleware(AccessLogMiddleware)  # added last: outermost, it sees every answer
    _add_error_handlers(app)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_stream_doc(ChatCompletionChunk), tags=["openai"])
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        """Chat completion; `stream: true` answers with server-sent events."""
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_stream_doc(CompletionResponse), tags=["openai"])
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        """Text completion of a prompt (text or token ids, one or a batch)."""
        return await create_completion(state, req, raw)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS, tags=["openai"])
    async def models() -> Any:
        cards = [ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
                 for name in state.model_names]
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS, tags=["openai"])
    async def model(model_id: str) -> Any:
        if model_id not in state.model_names:
            raise APIError(f"The model `{clip(model_id)}` does not exist.", 404, param="model")
        return ModelCard(id=model_id, root=state.model_root, max_model_len=state.max_model_len)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine runs; 503 once it has died (the process then exits) or stopped."""
        engine = state.engine.health()
        if not engine.alive:
            return JSONResponse(error_body(engine.detail, 503), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        """Prometheus metrics."""
        if state.engine.is_running:
            with contextlib.suppress(Exception):
                state.metrics.set_engine_stats(await asyncio.wait_for(state.engine.stats(), 10))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest, raw: Request) -> Any:
        state.check_model(req.model)
        if state.tokenizer is None or state.renderer is None:
            raise InvalidRequestError("this model has no tokenizer")
        if isinstance(req, TokenizeChatRequest):
            text = await state.run(raw, state.renderer.render, req.messages, tools=req.tools,
                                   add_generation_prompt=req.add_generation_prompt,
                                   chat_template_kwargs=req.chat_template_kwargs)
            ids = await state.run(raw, state.prompts.encode, text, add_special_tokens=False)
        else:
            ids = await state.run(raw, state.prompts.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return Response(await state.run(raw, _tokenize_body, state, ids, req.return_token_strs),
                        media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest, raw: Request) -> Any:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        await state.run(raw, state.check_token_ids, req.tokens, "tokens")
        return DetokenizeResponse(prompt=await state.run(raw, state.prompts.decode, req.tokens))

    return app


def _tokenize_body(state: ServerState, ids: list[int], with_strs: bool) -> bytes:
    """The /tokenize answer as JSON, written in slices so that a million ids never hold the GIL
    in one call (this runs on the pool, beside the event loop)."""
    step = 8192
    tokens = ",".join(",".join(map(str, ids[i : i + step])) for i in range(0, len(ids), step))
    strs = "null"
    if with_strs:
        strs = "[" + ",".join(json.dumps([state.token_str(t) for t in ids[i : i + step]], ensure_ascii=False)[1:-1]
                              for i in range(0, len(ids), step)) + "]"
    return (f'{{"count":{len(ids)},"max_model_len":{state.max_model_len},"tokens":[{tokens}],'
            f'"token_strs":{strs}}}').encode()


def _add_error_handlers(app: FastAPI) -> None:
    def answer(exc: BaseException, message: str | None = None, **kw: Any) -> JSONResponse:
        status = status_of(exc)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, EngineBusyError) else None
        kw.setdefault("param", getattr(exc, "param", None))
        return JSONResponse(error_body(str(exc) if message is None else message, status, **kw), status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, type=exc.type, param=exc.param), exc.status,
                            headers=exc.headers)

    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        return answer(exc)

    for kind in (InvalidRequestError, *ERROR_STATUS):  # busy, timed out, failed step, dead, cut
        app.add_exception_handler(kind, _refused)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return answer(exc, f"internal server error ({type(exc).__name__}); see the server log")

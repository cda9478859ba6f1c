"""The FastAPI application: routes, OpenAI-style errors, API-key check, and server state."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.errors import InvalidRequestError
from tokenmill.server.async_engine import AsyncEngine, EngineDeadError
from tokenmill.server.chat import ChatRenderer, load_chat_template
from tokenmill.server.metrics import CONTENT_TYPE, ServerMetrics
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
)
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.request_log import RequestLog
from tokenmill.server.serving import (
    APIError,
    ClientDisconnected,
    ServerState,
    error_body,
)
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.tool_parsers import detect_tool_parser, get_tool_parser

logger = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}


def _stream_doc(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "string", "description": f"with stream=true: `data: <{model.__name__}>` events, "
        "then `data: [DONE]`"}}}}, **_ERRORS}


def create_state(
    engine: Any, *, served_model_names: list[str] | None = None, chat_template: str | None = None,
    tool_call_parser: str = "auto", reasoning_parser: str | None = None, api_key: str | None = None,
    async_engine: AsyncEngine | None = None, trust_request_chat_template: bool = False,
    request_log_dir: str | None = None,
) -> ServerState:
    """Server state around a loaded LLMEngine (the AsyncEngine is started here unless given)."""
    try:  # the event loop tokenizes while the engine thread detokenizes: separate objects
        tokenizer = copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001
        tokenizer = engine.tokenizer
    renderer = ChatRenderer(tokenizer, load_chat_template(chat_template)) if tokenizer is not None else None
    template = renderer.chat_template if renderer is not None else None
    parser_name = detect_tool_parser(template) if tool_call_parser == "auto" else tool_call_parser
    get_tool_parser(parser_name)  # fail at start-up on an unknown name
    names = list(served_model_names or [engine.model_name])
    metrics = ServerMetrics(names[0])
    hf_config = getattr(engine, "hf_config", None)
    vocab = getattr(hf_config, "vocab_size", None) or (len(tokenizer) if tokenizer is not None else 0)
    source = getattr(engine, "source", None)
    root = str(getattr(source, "gguf_file", None) or getattr(source, "path", None) or names[0])
    return ServerState(
        engine=async_engine or AsyncEngine(engine, metrics),
        tokenizer=tokenizer, model_names=names, model_root=root,
        max_model_len=engine.config.model.max_model_len, vocab_size=int(vocab),
        renderer=renderer, tool_parser=parser_name,  # type: ignore[arg-type]
        reasoning=ReasoningParser(reasoning_parser) if reasoning_parser else None,
        metrics=metrics, api_key=api_key, trust_request_chat_template=trust_request_chat_template,
        request_log=RequestLog(request_log_dir) if request_log_dir else None,
    )


class _ApiKeyMiddleware:
    """Bearer-token check for the API routes (health, metrics and docs stay open)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse(error_body("Unauthorized: a valid API key is required", 401), 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


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


def build_app(state: ServerState, *, shutdown_engine: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if shutdown_engine:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(
        title="tokenmill", version=tokenmill.__version__, lifespan=lifespan,
        description="OpenAI-compatible LLM server",
    )
    app.state.tokenmill = state
    _serve_exact_openapi(app, state)
    if state.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(_validation_message(exc), 400), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, type=exc.type, param=exc.param), exc.status)

    @app.exception_handler(InvalidRequestError)
    async def _bad(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), 400)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 503), 503)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), 500)

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
            raise APIError(f"The model `{model_id}` does not exist.", 404, param="model")
        return ModelCard(id=model_id, root=state.model_root, max_model_len=state.max_model_len)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not state.engine.is_running:
            return JSONResponse(error_body("the engine is not running", 503), 503)
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
    async def tokenize(req: TokenizeRequest) -> Any:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        if isinstance(req, TokenizeChatRequest):
            text = state.renderer.render(req.messages, tools=req.tools,
                                         add_generation_prompt=req.add_generation_prompt,
                                         chat_template_kwargs=req.chat_template_kwargs)
            ids = state.renderer.encode(text)
        else:
            ids = list(state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = [state.token_str(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> Any:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        state.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))

    return app


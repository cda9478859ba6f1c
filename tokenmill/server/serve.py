"""`tokenmill serve`: load the model and run the OpenAI-compatible HTTP server.

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
--shutdown-timeout seconds, then stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tool_parsers import TOOL_PARSER_CHOICES

logger = logging.getLogger("tokenmill.serve")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as a positional alternative to --model (vLLM style)")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 to accept connections from other machines)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1, /tokenize and /detokenize "
                        "(default: $TOKENMILL_API_KEY; unset = no key)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is reported (default: the model's name)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (Jinja runs sandboxed, but costs CPU)")
    s.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="how tool calls are read from the model's text; auto picks from the chat template "
                        "(hermes <tool_call> tags, or llama3_json)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice auto is always enabled")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into reasoning_content (deepseek_r1: the answer starts "
                        "inside the thought; qwen3/think: only when it opens with <think>)")
    s.add_argument("--log-requests-dir", default=None, metavar="DIR",
                   help="append one JSON line per finished request (id, model, prompt and generated token ids, "
                        "finish reason, time) to DIR/requests-YYYY-MM-DD.jsonl (UTC day); "
                        "`tokenmill draft-vocab build --from DIR` reads them")
    s.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (access logs at info)")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the `serve` subcommand to tokenmill's command line."""
    from tokenmill.config import add_engine_args

    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_server, func=run_server)
    return parser


def _graceful_server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after draining (exit status 128+n); a drained
        server has shut down cleanly, so it exits 0 instead."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return GracefulServer


def build_server(args: argparse.Namespace) -> Any:
    """Loads the engine and returns a configured uvicorn.Server (not yet running)."""
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app, create_state

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit("tokenmill serve: give the model once (positional or --model)")
        args.model = args.model_tag
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    state = create_state(
        engine, served_model_names=args.served_model_name, chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        api_key=args.api_key, trust_request_chat_template=args.trust_request_chat_template,
        request_log_dir=args.log_requests_dir,
    )
    app = build_app(state)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=int(args.shutdown_timeout), timeout_keep_alive=30,
    )
    logger.info("serving %s (max_model_len %d) on http://%s:%d/v1", state.model_name,
                state.max_model_len, args.host, args.port)
    return _graceful_server_class()(config)


def run_server(args: argparse.Namespace) -> int:
    server = build_server(args)
    server.run()  # uvicorn handles SIGINT/SIGTERM: stop accepting, drain, lifespan shutdown
    return 0

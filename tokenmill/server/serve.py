"""`tokenmill serve`: load the model and run the OpenAI-compatible HTTP server.

Shutdown. SIGTERM (or Ctrl-C) stops accepting connections and logs the drain; requests in
flight may finish for up to --shutdown-timeout seconds; any still running then are ended (a
stream with a final `data: {"error": ...}` event and `data: [DONE]`, a non-streamed request
with a 503) and the engine stops.

Exit status, for supervisors (systemd, Kubernetes):
  0   clean shutdown: every request in flight finished within --shutdown-timeout
  2   start-up failed (a configuration that cannot be honoured, the port in use, ...)
  3   shutdown cut requests that were still running at the --shutdown-timeout deadline
  70  the engine died (it cannot step any more); /health answers 503 until the process exits,
      so restart it
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING, Any

from tokenmill.config import _byte_size
from tokenmill.errors import ConfigError
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tool_parsers import TOOL_PARSER_CHOICES

if TYPE_CHECKING:
    from tokenmill.server.serving import ServerState

logger = logging.getLogger("tokenmill.serve")

EXIT_OK = 0
EXIT_REQUESTS_CUT = 3
EXIT_ENGINE_DEAD = 70  # EX_SOFTWARE
_FLUSH_GRACE_S = 5.0  # after the drain: time for cut streams to send their last events


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help unless the help already says its default, or there
    is none to say (None, or off for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


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
    s.add_argument("--refusal-detector", default="auto", choices=["auto", "on", "off"],
                   help="judge every response for refusal: a `refusal` object ({score, refused, signal}) in each choice "
                        "(streamed: in its last chunk) and the tokenmill:refusal_* counters by steering strength. auto = "
                        "on with --steering (the direction's projection plus a phrase list), off without; on without "
                        "--steering uses the phrase list only (default: auto)")
    s.add_argument("--log-requests-dir", default=None, metavar="DIR",
                   help="append one JSON line per finished request (id, model, prompt and generated token ids, "
                        "finish reason, time) to DIR/requests-YYYY-MM-DD.jsonl (UTC day); "
                        "`tokenmill draft-vocab build --from DIR` reads them")
    s.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; those still running "
                        "then are ended with an error and the exit status is 3")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server itself (its own access log stays off: see --access-log)")
    s.add_argument("--access-log", action="store_true",
                   help="log one line per request (client, method, path, status, prompt and completion tokens, "
                        "latency) to the tokenmill.access logger; off by default")
    lim = parser.add_argument_group("limits (hostile or overloaded clients)")
    lim.add_argument("--max-request-bytes", type=_byte_size, default=8 * 2**20, metavar="BYTES",
                     help="largest request body, e.g. 8M; larger ones get 413 before they are parsed")
    lim.add_argument("--max-grammar-bytes", type=_byte_size, default=32 * 2**10, metavar="BYTES",
                     help="largest structured-output grammar (a JSON schema as sent, a regex, an EBNF grammar, the "
                          "tools' schemas); larger ones get 400 (compiling one takes time that grows steeply with it)")
    lim.add_argument("--max-header-bytes", type=_byte_size, default=32 * 2**10, metavar="BYTES",
                     help="largest request line + headers; larger ones get 431")
    lim.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                     help="sequences that may wait for the engine (n samples count n); past it requests get "
                          "429 with Retry-After. 0 = no limit")
    lim.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                     help="abort a request (freeing its KV blocks) that has not finished this many seconds "
                          "after it arrived: 504, or an error event in a stream (default: no deadline)")
    lim.add_argument("--tokenizer-workers", type=int, default=None, metavar="N",
                     help="threads that parse bodies, tokenize and apply chat templates, off the event loop "
                          "(default: the cores less one, 1 to 4)")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the `serve` subcommand to tokenmill's command line."""
    from tokenmill.config import add_engine_args

    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics).",
        formatter_class=HelpFormatter,
    )
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_server, func=run_server, gc_off_until_ready=True)
    return parser


def _server_class() -> type:
    import uvicorn

    class TokenmillServer(uvicorn.Server):
        """uvicorn with tokenmill's shutdown: the drain (logged, bounded, cutting what is left),
        an exit on engine death, and the exit status of the module docstring."""

        def __init__(self, config: Any, state: ServerState, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.state = state
            self.shutdown_timeout = shutdown_timeout
            self.exit_code = EXIT_OK

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                logger.warning("%s: no new connections; %d requests in flight may finish within %g s "
                               "(--shutdown-timeout)", signal.Signals(sig).name, self.state.engine.num_requests,
                               self.shutdown_timeout)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after shutting down (status 128+n); the status is ours
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def on_tick(self, counter: int) -> bool:
            if self.exit_code == EXIT_OK and not self.state.engine.is_running:
                logger.critical("the engine died (%s): exiting with status %d so that a supervisor restarts "
                                "the server", self.state.engine.health().detail, EXIT_ENGINE_DEAD)
                self.exit_code = EXIT_ENGINE_DEAD
                self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for server in self.servers:
                server.close()  # no new connections while draining
            for connection in list(self.server_state.connections):
                connection.shutdown()  # idle keep-alive connections close now, busy ones after their answer
            if self.exit_code == EXIT_OK:
                self.exit_code = await self._drain()
            await super().shutdown(sockets)

        async def _drain(self) -> int:
            loop = asyncio.get_running_loop()
            started = loop.time()
            engine = self.state.engine
            drain = asyncio.ensure_future(engine.drain(self.shutdown_timeout))
            while not drain.done() and not self.force_exit:  # a second Ctrl-C stops waiting
                await asyncio.wait({drain}, timeout=0.1)
            if drain.done():
                cut = drain.result()
            else:
                drain.cancel()
                cut = await engine.drain(0)
            if not engine.is_running:
                return EXIT_ENGINE_DEAD
            deadline = started + self.shutdown_timeout + _FLUSH_GRACE_S
            while self.server_state.connections and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            left = len(self.server_state.connections)
            if cut or left:
                logger.warning("shutdown deadline: %d requests cut with an error, %d connections closed unfinished; "
                               "exit status %d", cut, left, EXIT_REQUESTS_CUT)
                return EXIT_REQUESTS_CUT
            logger.info("drained in %.1f s", loop.time() - started)
            return EXIT_OK

        def run_until_exit(self, sockets: list[socket.socket]) -> int:
            self.run(sockets=sockets)
            return self.exit_code

    return TokenmillServer


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads (ConfigError when it is in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}; stop whatever holds it, or pick "
                          "another --port") from None
    sock.set_inheritable(True)
    return sock


def build_server(args: argparse.Namespace, sock: socket.socket) -> Any:
    """Loads the engine and returns a configured TokenmillServer (not yet running)."""
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine
    from tokenmill.server.app import build_app, state_for_engine
    from tokenmill.server.http_limits import TokenmillH11Protocol

    if args.max_waiting_requests < 0:
        raise ConfigError("--max-waiting-requests must not be negative (0 = no limit)")
    if args.tokenizer_workers is not None and args.tokenizer_workers < 1:
        raise ConfigError("--tokenizer-workers must be at least 1")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ConfigError("--request-timeout must be positive (leave it out for no deadline)")
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    state = state_for_engine(
        engine, served_model_names=args.served_model_name, chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        api_key=args.api_key, trust_request_chat_template=args.trust_request_chat_template,
        request_log_dir=args.log_requests_dir, request_timeout=args.request_timeout,
        tokenizer_workers=args.tokenizer_workers, max_waiting_requests=args.max_waiting_requests or None,
        refusal_detector=args.refusal_detector,
    )
    state.max_grammar_bytes = args.max_grammar_bytes
    app = build_app(state, max_request_bytes=args.max_request_bytes, max_header_bytes=args.max_header_bytes,
                    access_log=args.access_log)
    config = uvicorn.Config(
        app, log_level=args.uvicorn_log_level, access_log=False, http=TokenmillH11Protocol,
        h11_max_incomplete_event_size=args.max_header_bytes,
        timeout_graceful_shutdown=int(_FLUSH_GRACE_S), timeout_keep_alive=30,
    )
    gc.collect()
    gc.freeze()  # what start-up built lives as long as the server: full collections skip it
    gc.enable()  # `tokenmill serve` starts up without it (cli.main, gc_off_until_ready)
    logger.info("serving %s (max_model_len %d) on http://%s:%d/v1", state.model_name,
                state.max_model_len, args.host, args.port)
    return _server_class()(config, state, args.shutdown_timeout)


def run_server(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit("tokenmill serve: give the model once (positional or --model)")
        args.model = args.model_tag
    sock = bind_socket(args.host, args.port)
    return build_server(args, sock).run_until_exit([sock])

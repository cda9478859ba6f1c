"""Starting real tokenmill servers for tests: in-process (uvicorn in a thread) on a free
loopback port, or as a `tokenmill serve` subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    state: Any  # tokenmill.server.serving.ServerState
    engine: Any  # the LLMEngine: touch it only through state.engine.call (engine thread)
    server: Any
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=kwargs.pop("timeout", 300), **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0,
                                  timeout=kwargs.pop("timeout", 300), **kwargs)

    def engine_stats(self) -> Any:
        import asyncio

        return asyncio.run(self.state.engine.stats())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


MAX_REQUEST_BYTES = 8 * 2**20  # serve's defaults
MAX_HEADER_BYTES = 32 * 2**10


def serve_state(state: Any, engine: Any, *, shutdown_engine: bool = True, **app_options: Any) -> RunningServer:
    """The app over `state` on uvicorn, configured as `tokenmill serve` configures it."""
    import uvicorn

    from tokenmill.server.app import build_app
    from tokenmill.server.http_limits import TokenmillH11Protocol

    limits = {"max_request_bytes": MAX_REQUEST_BYTES, "max_header_bytes": MAX_HEADER_BYTES}
    app = build_app(state, shutdown_engine=shutdown_engine, **{**limits, **app_options})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=30, access_log=False, http=TokenmillH11Protocol,
                                           h11_max_incomplete_event_size=MAX_HEADER_BYTES))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", state, engine, server, thread)


def start_server(engine: Any, **state_kwargs: Any) -> RunningServer:
    from tokenmill.server.app import state_for_engine

    return serve_state(state_for_engine(engine, **state_kwargs), engine)


@contextlib.contextmanager
def start_server_on(running: RunningServer, *, app_options: dict[str, Any] | None = None,
                    **state_kwargs: Any) -> Iterator[RunningServer]:
    """Another app (other server options) sharing `running`'s engine thread and metrics."""
    from tokenmill.server.app import create_state

    state = create_state(running.state.engine, metrics=running.state.metrics, **state_kwargs)
    other = serve_state(state, running.engine, shutdown_engine=False, **(app_options or {}))
    try:
        yield other
    finally:
        other.stop()


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def spawn_server(args: list[str], log_path: str, *, timeout: float = 240, launcher: list[str] | None = None,
                 port: int | None = None) -> ServerProcess:
    """`python -m tokenmill.cli serve ARGS` on a free port (or `python LAUNCHER... serve ARGS`);
    waits for /health."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = launcher or ["-m", "tokenmill.cli"]
    with open(log_path, "w", encoding="utf-8") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, *command, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    running = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{running.log()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return running
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up:\n{running.log()[-3000:]}")

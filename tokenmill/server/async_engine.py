"""AsyncEngine: the synchronous LLMEngine stepped in one background thread, fed by asyncio.

The engine is not thread-safe, so every call into it happens on the engine thread. asyncio code
sends commands (add, abort, call, cut, stop) through a queue; the thread drains the queue
between steps and hands each step's outputs to the requests' streams with
call_soon_threadsafe. With nothing to run, the thread blocks on the command queue: an idle
server does not spin. AsyncEngine is the in-process `EngineClient`.

Failures. A step that raises fails the requests it held (`LLMEngine.abort_failed_step`: the
running batch and the step in flight, whose state the failed step may have left half-done)
with StepFailedError; waiting requests and the engine go on. The engine is dead — every stream
fails with EngineDeadError, `is_running` turns False, and `tokenmill serve` exits with status
70 — when MAX_CONSECUTIVE_STEP_FAILURES steps fail in a row (a sticky device error), when the
recovery itself raises, or when the thread's own bookkeeping raises.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.server.engine_client import (
    END_OF_STREAM,
    ChildRequest,
    EngineBusyError,
    EngineDeadError,
    EngineHealth,
    ModelInfo,
    RequestCutError,
    RequestMetricsSink,
    RequestStream,
    StepFailedError,
    SteppableEngine,
    model_info_of,
)

if TYPE_CHECKING:
    from tokenmill.engine.engine import EngineStats

__all__ = ["AsyncEngine", "ChildRequest", "EngineDeadError", "RequestStream", "SteppableEngine"]

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
RETRY_AFTER_S = 1  # what a refused request is told to wait (the queue moves at the engine's pace)


@dataclass
class _Child:
    stream: RequestStream
    index: int
    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class _EngineCannotContinue(RuntimeError):
    pass


class AsyncEngine:
    """Runs `engine.step()` on its own thread; serves any number of asyncio callers.

    `max_waiting_requests` bounds the engine's waiting queue (sequences not yet scheduled):
    a request that would exceed it is refused with EngineBusyError. `before_step` is a test
    seam: called on the engine thread before every step, and what it raises counts as that
    step failing.
    """

    def __init__(self, engine: SteppableEngine, metrics: RequestMetricsSink | None = None, *,
                 max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.before_step: Callable[[], None] | None = None
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._children: dict[str, _Child] = {}  # engine thread only
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._model_info: ModelInfo | None = None
        self._dead: BaseException | None = None
        self._refusing: str | None = None  # why new requests are refused (shutting down)
        self._stopping = False
        self._consecutive_failures = 0
        self._closed = False  # the thread has stopped taking commands
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side

    @property
    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            self._model_info = model_info_of(self.engine)
        return self._model_info

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def health(self) -> EngineHealth:
        if self.is_running:
            return EngineHealth(True, "ok")
        return EngineHealth(False, f"the engine is not running ({self._dead or 'stopped'})")

    @property
    def num_in_flight(self) -> int:
        return len(self._children)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def submit(
        self, request_id: str, children: list[ChildRequest], *, priority: int = 0,
        cache_salt: str | None = None, timeout: float | None = None, steering: dict[str, float] | None = None,
    ) -> RequestStream:
        self._check_alive()
        stream = RequestStream(request_id, len(children), self._send_abort)
        if timeout is not None:
            stream.set_deadline(timeout, f"the request did not finish within --request-timeout ({timeout:g} s "
                                         "left when it was queued) and was aborted")
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._send(("add", stream, children, priority, cache_salt, steering, ack))
        try:
            await ack
        except asyncio.CancelledError:
            stream.abort()
            raise
        self._streams[request_id] = stream
        stream.add_done_callback(lambda s: self._streams.pop(s.request_id, None))
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the engine thread between steps (in-process tools and tests)."""
        self._check_alive()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._send(("call", fn, future))
        return await future

    async def stats(self) -> EngineStats:
        return await self.call(lambda engine: engine.stats())

    async def drain(self, timeout: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and self.is_running and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._refusing = "the server is shutting down"
        if not self._streams or not self.is_running:
            return 0
        future: asyncio.Future[int] = loop.create_future()
        self._send(("cut", RequestCutError(
            f"the server shut down before this request finished (--shutdown-timeout {timeout:g} s)"), future))
        return await future

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left and stops the thread (after the HTTP side has drained)."""
        self._stopping = True
        self._send(("stop",))
        self._thread.join(timeout)

    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        if self._closed:  # the thread may have drained the queue for the last time already
            self._fail_pending_commands()

    def _send_abort(self, stream: RequestStream) -> None:
        self._send(("abort", stream))

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        if self._refusing is not None:
            raise EngineDeadError(self._refusing)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            logger.critical("the engine cannot continue: %r", exc, exc_info=exc)
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine stopped ({type(exc).__name__})"))
        else:
            self._dead = EngineDeadError("the engine was shut down")
            self._fail_all(self._dead)
        self._closed = True
        self._fail_pending_commands()

    def _step(self) -> None:
        try:
            if self.before_step is not None:
                self.before_step()
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one failed step fails its requests, not the server
            self._step_failed(exc)
            return
        self._consecutive_failures = 0
        if outputs:
            self._dispatch(outputs, time.monotonic())

    def _step_failed(self, exc: Exception) -> None:
        self._consecutive_failures += 1
        failures = self._consecutive_failures
        logger.error("an engine step failed (%d in a row): %r", failures, exc, exc_info=exc)
        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineCannotContinue(f"{failures} engine steps failed in a row; the last: {exc!r}") from exc
        failed = self.engine.abort_failed_step()
        error = StepFailedError(f"the engine failed while running this request ({type(exc).__name__}); "
                                "the request was aborted")
        now = time.monotonic()
        streams: dict[int, RequestStream] = {}
        for child_id in failed:
            child = self._children.pop(child_id, None)
            if child is not None:
                self._record_finish(child, "error", now)
                streams[id(child.stream)] = child.stream
        for stream in streams.values():
            self._abort(stream)  # its siblings, which the step may not have held
            stream.deliver_threadsafe([error])
        logger.warning("aborted %d requests of the failed step: %s", len(streams),
                       ", ".join(s.request_id for s in streams.values()))

    def _handle_commands(self, block: bool) -> bool:
        """Runs queued commands; blocks for the first one when idle. False on stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "cut":
                _resolve(command[2], result=self._cut(command[1]))
            elif kind == "call":
                fn, future = command[1], command[2]
                try:
                    result = fn(self.engine)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    _resolve(future, exc=exc)
                else:
                    _resolve(future, result=result)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(
        self, stream: RequestStream, children: list[ChildRequest], priority: int,
        cache_salt: str | None, steering: dict[str, float] | None, ack: asyncio.Future[None],
    ) -> None:
        if stream.finished:  # the client left (or the deadline passed) before the engine saw it
            _resolve(ack, result=None)
            return
        limit = self.max_waiting_requests
        if limit is not None:
            if len(children) > limit:
                _resolve(ack, exc=InvalidRequestError(
                    f"this request has {len(children)} sequences, more than the server queues "
                    f"(--max-waiting-requests {limit})"))
                return
            waiting = self.engine.num_waiting
            if waiting + len(children) > limit:
                _resolve(ack, exc=EngineBusyError(
                    f"the server is busy: {waiting} sequences are waiting to be scheduled "
                    f"(--max-waiting-requests {limit}); retry in a moment", RETRY_AFTER_S))
                return
        added: list[str] = []
        now = time.monotonic()
        try:
            for index, (child_id, child) in enumerate(zip(stream.child_ids, children)):
                self.engine.add_request(
                    child_id, child.prompt, child.params, priority=priority, cache_salt=cache_salt, steering=steering
                )
                added.append(child_id)
                num_prompt = len(child.prompt) if isinstance(child.prompt, list) else 0
                self._children[child_id] = _Child(stream, index, now, num_prompt)
        except Exception as exc:  # noqa: BLE001 - InvalidRequestError and friends go back
            for child_id in added:
                self.engine.abort_request(child_id)
                self._children.pop(child_id, None)
            _resolve(ack, exc=exc)
            return
        _resolve(ack, result=None)

    def _abort(self, stream: RequestStream) -> None:
        now = time.monotonic()
        for child_id in stream.child_ids:
            child = self._children.pop(child_id, None)
            if child is not None:
                self.engine.abort_request(child_id)
                self._record_finish(child, "abort", now)

    def _cut(self, error: RequestCutError) -> int:
        streams = {id(c.stream): c.stream for c in self._children.values()}
        for stream in streams.values():
            self._abort(stream)
            stream.deliver_threadsafe([error])
        return len(streams)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        batches: dict[int, tuple[RequestStream, list[Any]]] = {}
        for output in outputs:
            child = self._children.get(output.request_id)
            if child is None:
                continue  # aborted meanwhile
            if output.prompt_token_ids:
                child.num_prompt_tokens = len(output.prompt_token_ids)
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if num_new:
                if self._metrics is not None:
                    self._metrics.on_tokens(now, child.last_token, child.arrival)
                if child.first_token is None:
                    child.first_token = now
                child.last_token = now
                child.num_generated += num_new
            entry = batches.setdefault(id(child.stream), (child.stream, []))
            entry[1].append((child.index, output))
            if output.finished:
                del self._children[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._record_finish(child, reason or "stop", now)
                if all(cid not in self._children for cid in child.stream.child_ids):
                    entry[1].append(END_OF_STREAM)
        for stream, items in batches.values():
            stream.deliver_threadsafe(items)

    def _record_finish(self, child: _Child, reason: str, now: float) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.on_request_finished(
                reason, child.arrival, child.first_token, now, child.num_prompt_tokens,
                child.num_generated,
            )
        except Exception:
            logger.exception("recording request metrics failed")

    def _fail_all(self, exc: BaseException) -> None:
        streams = {id(c.stream): c.stream for c in self._children.values()}
        self._children.clear()
        for stream in streams.values():
            stream.deliver_threadsafe([exc])

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "cut":
                _resolve(command[2], result=0)
            elif command[0] in ("add", "call"):
                _resolve(command[-1], exc=EngineDeadError("the engine is not running"))


def _resolve(future: asyncio.Future[Any], *, result: Any = None, exc: BaseException | None = None) -> None:
    """Completes an asyncio future from the engine thread (ignoring one already cancelled)."""

    def complete() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(complete)
    except RuntimeError:
        pass

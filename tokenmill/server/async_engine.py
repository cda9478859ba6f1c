"""AsyncEngine: the synchronous LLMEngine stepped in one background thread, fed by asyncio.

The engine is not thread-safe, so every call into it happens on the engine thread. asyncio code
sends commands (add, abort, call) through a queue; the thread drains the queue between steps
and hands each step's outputs to the per-request asyncio queues with call_soon_threadsafe.
With nothing to run, the thread blocks on the command queue: an idle server does not spin.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a crash or shutdown); no new request can be served."""


class RequestMetricsSink(Protocol):
    def on_request_finished(
        self, finish_reason: str, arrival: float, first_token: float | None, end: float,
        num_prompt_tokens: int, num_generation_tokens: int,
    ) -> None: ...

    def on_tokens(self, now: float, previous: float | None, arrival: float) -> None: ...


@dataclass
class ChildRequest:
    """One engine request (one of a request's n samples, or one of a batch's prompts)."""

    prompt: str | list[int]
    params: SamplingParams


@dataclass
class _Child:
    stream: RequestStream
    index: int
    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


_END = object()


class RequestStream:
    """The outputs of one API request: (child index, RequestOutput delta) in arrival order."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_children: int) -> None:
        self.request_id = request_id
        self.child_ids = [f"{request_id}-{i}" for i in range(num_children)]
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.observer: Any = None  # sees every output as it is consumed (the request log)

    # Called on the event loop (scheduled from the engine thread).
    def _push(self, items: list[Any]) -> None:
        for item in items:
            self._queue.put_nowait(item)

    def _deliver_threadsafe(self, items: list[Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._push, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while True:
            item = await self._queue.get()
            if item is _END:
                self.finished = True
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if self.observer is not None:
                self.observer.output(*item)
            yield item

    def abort(self) -> None:
        """Stop every unfinished child and free its blocks (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._engine._send(("abort", self))
            if self.observer is not None:
                self.observer.aborted()
            self._queue.put_nowait(_END)  # wake a consumer waiting for the next output


class AsyncEngine:
    """Runs `engine.step()` on its own thread; serves any number of asyncio callers."""

    def __init__(self, engine: Any, metrics: RequestMetricsSink | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._children: dict[str, _Child] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._children)

    async def submit(
        self, request_id: str, children: list[ChildRequest], *, priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Adds every child to the engine; raises the engine's InvalidRequestError (nothing is
        left running then) or EngineDeadError. Returns once the engine has accepted them all."""
        self._check_alive()
        stream = RequestStream(self, request_id, len(children))
        ack: asyncio.Future[None] = stream._loop.create_future()
        self._send(("add", stream, children, priority, cache_salt, ack))
        try:
            await ack
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._send(("call", fn, future))
        return await future

    async def stats(self) -> Any:
        return await self.call(lambda engine: engine.stats())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left and stops the thread (after the HTTP side has drained)."""
        self._stopping = True
        self._send(("stop",))
        self._thread.join(timeout)

    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._dispatch(outputs, time.monotonic())
        except BaseException as exc:
            logger.exception("the engine thread died")
            self._dead = exc
            self._fail_all(EngineDeadError(f"the engine stopped: {exc!r}"))
            self._fail_pending_commands()
            return
        self._dead = EngineDeadError("the engine was shut down")
        self._fail_all(self._dead)
        self._fail_pending_commands()

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
        cache_salt: str | None, ack: asyncio.Future[None],
    ) -> None:
        if stream.finished:  # the client left before the engine saw the request
            _resolve(ack, result=None)
            return
        added: list[str] = []
        now = time.monotonic()
        try:
            for index, (child_id, child) in enumerate(zip(stream.child_ids, children)):
                self.engine.add_request(
                    child_id, child.prompt, child.params, priority=priority, cache_salt=cache_salt
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
                    entry[1].append(_END)
        for stream, items in batches.values():
            stream._deliver_threadsafe(items)

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
            stream._deliver_threadsafe([exc])

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future = command[-1] if command[0] in ("add", "call") else None
            if future is not None:
                _resolve(future, exc=EngineDeadError("the engine is not running"))


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


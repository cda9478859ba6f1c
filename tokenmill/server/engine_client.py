"""The server's view of an engine: the engine-client protocol and the stream of one request.

The HTTP layer talks to an engine only through `EngineClient`: submit a request (its children:
the n samples of a prompt, or a batch of prompts), abort it, read statistics and the model's
facts, check liveness, drain and shut down. `AsyncEngine` implements it for the engine stepped
on a thread of this process; a multi-process engine or a router implements the same protocol
and hands out the same `RequestStream`s, so nothing above this file changes.

Every way a request can end early is an exception the stream raises to its reader, and each
maps to one HTTP status (`ERROR_STATUS`): the server answers it as a JSON error before the
first byte, or as a final `data: {"error": ...}` event of a stream.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokenmill.models.steering_file import DetectorCalibration
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import EngineStats


class EngineDeadError(RuntimeError):
    """The engine stopped (it crashed or was shut down); no new request can be served."""


class EngineBusyError(RuntimeError):
    """The waiting queue is full: the request was refused before the engine saw it."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(RuntimeError):
    """The request ran past its deadline and was aborted (its KV blocks are freed)."""


class StepFailedError(RuntimeError):
    """An engine step that held this request raised; the request was aborted, the engine goes on."""


class RequestCutError(RuntimeError):
    """The server shut down before the request finished (the drain deadline passed)."""


ERROR_STATUS: dict[type[BaseException], int] = {
    EngineBusyError: 429, StepFailedError: 500, EngineDeadError: 503, RequestCutError: 503,
    RequestTimeoutError: 504,
}


@dataclass
class ChildRequest:
    """One engine request (one of a request's n samples, or one of a batch's prompts)."""

    prompt: str | list[int]
    params: SamplingParams


@dataclass(frozen=True)
class SteeringInfo:
    """The served steering file, as the server sees it."""

    directions: tuple[str, ...]
    max_strength: float
    calibrations: dict[str, DetectorCalibration | None]  # per direction: the refusal detector's


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the served model."""

    name: str
    root: str  # the checkpoint (file or directory) the model card reports
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # a Hugging Face tokenizer for the server's own use, or None
    steering: SteeringInfo | None = None  # None: the engine steers nothing (--steering not given)


@dataclass(frozen=True)
class EngineHealth:
    alive: bool
    detail: str


class StreamObserver(Protocol):
    """Sees a request's outputs as they are read, and its end when it is cut short."""

    def output(self, index: int, output: RequestOutput) -> None: ...

    def aborted(self) -> None: ...


_END = object()


class RequestStream:
    """The outputs of one API request: (child index, RequestOutput delta) in arrival order.

    Outputs are delivered from any thread (`deliver_threadsafe`); reading happens on the event
    loop that created the stream. A stream ends when every child has finished, or early by
    `abort()` (the reader sees a plain end) or `fail(exc)` (the reader sees `exc`); both tell
    the engine to drop the unfinished children through `on_abort`, once.
    """

    def __init__(self, request_id: str, num_children: int, on_abort: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.child_ids = [f"{request_id}-{i}" for i in range(num_children)]
        self._on_abort = on_abort
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._deadline: asyncio.TimerHandle | None = None
        self._done_callbacks: list[Callable[[RequestStream], None]] = []
        self.finished = False  # no more outputs are accepted (ended, aborted or failed)
        self.observer: StreamObserver | None = None  # the request log

    def add_done_callback(self, callback: Callable[[RequestStream], None]) -> None:
        """Calls callback(self) once the stream has ended (at once if it has already)."""
        if self.finished:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    def set_deadline(self, timeout: float, message: str) -> None:
        """Fails the stream with RequestTimeoutError(message) unless it ends within `timeout` s."""
        self._deadline = self._loop.call_later(timeout, self.fail, RequestTimeoutError(message))

    # Called on the event loop (scheduled from the engine thread).
    def _push(self, items: list[Any]) -> None:
        if self.finished:
            return
        for item in items:
            self._queue.put_nowait(item)
            if item is _END or isinstance(item, BaseException):
                self._close()
                if item is not _END and self.observer is not None:
                    self.observer.aborted()  # the engine ended it early: its unfinished children
                return

    def deliver_threadsafe(self, items: list[Any]) -> None:
        """Outputs `(index, RequestOutput)`, then END_OF_STREAM or an exception, from any thread."""
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
                return
            if isinstance(item, BaseException):
                raise item
            if self.observer is not None:
                self.observer.output(*item)
            yield item

    def abort(self) -> None:
        """Stops every unfinished child and frees its blocks (safe to call more than once)."""
        self._end_early(_END)

    def fail(self, exc: BaseException) -> None:
        """Like abort(), but the reader gets `exc` instead of a plain end."""
        self._end_early(exc)

    def _end_early(self, item: Any) -> None:
        if self.finished:
            return
        self._close()
        self._on_abort(self)
        if self.observer is not None:
            self.observer.aborted()
        self._queue.put_nowait(item)  # wakes a reader waiting for the next output

    def _close(self) -> None:
        self.finished = True
        if self._deadline is not None:
            self._deadline.cancel()
        for callback in self._done_callbacks:
            callback(self)
        self._done_callbacks.clear()


END_OF_STREAM = _END


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP layer may ask of an engine."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def is_running(self) -> bool:
        """Liveness: False once the engine has died or been shut down."""
        ...

    def health(self) -> EngineHealth: ...

    @property
    def num_in_flight(self) -> int:
        """Engine sequences (children) submitted and not finished."""
        ...

    @property
    def num_requests(self) -> int:
        """API requests (streams) submitted and not finished."""
        ...

    async def submit(
        self, request_id: str, children: list[ChildRequest], *, priority: int = 0,
        cache_salt: str | None = None, timeout: float | None = None, steering: dict[str, float] | None = None,
    ) -> RequestStream:
        """Adds every child; returns once the engine accepted them all. Raises the engine's
        InvalidRequestError (nothing is left running then), EngineBusyError or EngineDeadError.
        With `timeout`, the stream fails with RequestTimeoutError that many seconds from now;
        `steering`: strengths per direction of the served steering file, for every child."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def drain(self, timeout: float) -> int:
        """Waits up to `timeout` s for the requests in flight, then ends the rest with
        RequestCutError and refuses new ones. Returns how many requests were cut."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine (after the HTTP side has drained); blocking."""
        ...


# ------------------------------------------------- what an in-process engine client drives


class SteppableEngine(Protocol):
    """What AsyncEngine needs of the engine it steps (LLMEngine, or a stand-in in tests; the
    model attributes are read once, when the server first asks for `model_info`)."""

    model_name: str
    tokenizer: Any
    hf_config: Any
    source: Any
    config: EngineConfig

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None, steering: dict[str, float] | None = None) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def abort_failed_step(self) -> list[str]: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> Any: ...


class RequestMetricsSink(Protocol):
    def on_request_finished(
        self, finish_reason: str, arrival: float, first_token: float | None, end: float,
        num_prompt_tokens: int, num_generation_tokens: int,
    ) -> None: ...

    def on_tokens(self, now: float, previous: float | None, arrival: float) -> None: ...


def model_info_of(engine: SteppableEngine) -> ModelInfo:
    """The served facts of a loaded LLMEngine; the tokenizer is the server's own copy (the engine
    thread detokenizes with the engine's)."""
    tokenizer = engine.tokenizer
    try:
        tokenizer = copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared
        pass
    vocab = getattr(engine.hf_config, "vocab_size", None) or (len(tokenizer) if tokenizer is not None else 0)
    source = engine.source
    root = str(getattr(source, "gguf_file", None) or getattr(source, "path", None) or engine.model_name)
    file = getattr(engine, "steering", None)
    steering = None if file is None else SteeringInfo(
        tuple(file.directions), engine.config.steering.steering_max_strength,
        {name: d.calibration for name, d in file.directions.items()})
    return ModelInfo(engine.model_name, root, engine.config.model.max_model_len, int(vocab), tokenizer, steering)

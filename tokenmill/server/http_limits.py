"""Limits enforced before the application parses anything: the request head (431) and the
request body (413), both answered with OpenAI-shaped JSON errors.

The body limit reads the whole body before the app sees it (the app reads it whole anyway) and
checks a declared Content-Length first. A refused body is still read up to a bound and thrown
away, so the client gets its 413 instead of a connection reset while it is still sending.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.server.serving import error_body

ASGIApp = Any  # (scope, receive, send) -> Awaitable[None]
_DRAIN_FACTOR = 4  # a refused body is read and dropped up to this many times the limit
DEFAULT_MAX_HEADER_BYTES = 16 * 1024  # h11's own default
_CLOSE_AFTER_ERROR_S = 5.0


async def send_json_error(send: Any, status: int, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before the app reads any of it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(receive, send, declared=int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(receive, send, read=size, more=message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the server's would

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Any, send: Any, *, declared: int | None = None, read: int = 0,
                      more: bool = True) -> None:
        """Reads what the client is still sending (up to a bound), then answers 413."""
        while more and read < _DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        size = f"{declared}" if declared is not None else f"more than {read}" if more else f"{read}"
        await send_json_error(send, 413, f"the request body is {size} bytes; this server accepts at most "
                                         f"--max-request-bytes {self.max_bytes}", [(b"connection", b"close")])


class HeaderLimitMiddleware:
    """431 for a request line and headers over `max_bytes` (h11 only limits a head that arrives
    in pieces; one read brings up to 256 KiB)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
                len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_bytes:
                await send_json_error(send, 431, f"the request line and headers are {size} bytes; this server "
                                                 f"accepts at most --max-header-bytes {self.max_bytes}",
                                      [(b"connection", b"close")])
                return
        await self.app(scope, receive, send)


class TokenmillH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request head over the limit with 431 (uvicorn sends
    400 for every malformed request) and every malformed request with a JSON error body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEADER_BYTES
        self.conn = _RecordingConnection(h11.SERVER, self.head_limit)

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # answered already: the rest of what the client sends is dropped
        self.loop.call_later(_CLOSE_AFTER_ERROR_S, self.transport.close)  # time to read the answer first
        error = self.conn.last_error
        status = getattr(error, "error_status_hint", 400)
        if status == 431:
            message = (f"the request line and headers are more than {self.head_limit} bytes, more than this "
                       "server accepts (--max-header-bytes)")
        else:
            message = f"invalid HTTP request: {error or msg}"
        body = json.dumps(error_body(message, status)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))


class _RecordingConnection(h11.Connection):
    """Keeps the protocol error that made uvicorn answer with an error response."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.last_error = error
            raise

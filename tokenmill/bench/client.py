"""Streaming OpenAI-compatible HTTP client: one RequestRecord per request, never a raise.

Failures (refused connection, 4xx/5xx, a stream cut before `data: [DONE]`, a timeout) are
written into `RequestRecord.error` so a run can count and report them; only set-up calls
(`models`, `chat`) raise BenchError.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tokenmill.bench.errors import BenchError, ServerUnreachable
from tokenmill.bench.record import RequestRecord, apply_delta


def normalize_base_url(url: str) -> str:
    """Accept llama-benchy's `http://h:p/v1` and vLLM's `http://h:p` alike."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    path = urlsplit(url).path
    return url if path not in ("", "/") else url + "/v1"


def describe_exception(exc: BaseException, url: str, timeout: float) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {url}: {exc.os_error.strerror or exc}"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        return f"stream cut: server closed the connection ({type(exc).__name__})"
    if isinstance(exc, asyncio.TimeoutError):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, aiohttp.ClientError):
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def http_error_message(status: int, body: str) -> str:
    message = body.strip()
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(err, dict):
            message = str(err.get("message") or err.get("detail") or err)
        elif isinstance(data, dict) and "detail" in data:
            message = str(data["detail"])
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {message[:300]}"


class Client:
    """One aiohttp session for a whole run; use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str = "EMPTY",
        extra_body: dict[str, Any] | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model or ""
        self.extra_body = dict(extra_body or {})
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=600)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=30),
            headers=self.headers,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Client used outside `async with`"
        return self._session

    # ---- set-up calls: raise BenchError with a clear message -------------------------------

    async def models(self) -> list[dict[str, Any]]:
        url = f"{self.base_url}/models"
        try:
            async with self.session.get(url) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise BenchError(f"GET {url} failed: {http_error_message(resp.status, body)}")
                data = json.loads(body)
        except aiohttp.ClientError as exc:
            raise ServerUnreachable(
                f"{describe_exception(exc, url, self.timeout)}. Is the server running at {self.base_url}?"
            ) from None
        except TimeoutError:
            raise ServerUnreachable(f"GET {url} timed out after {self.timeout:g} s") from None
        except ValueError:
            raise BenchError(f"GET {url} did not return JSON") from None
        models = data.get("data") or data.get("models") or []
        return [m for m in models if isinstance(m, dict)]

    async def resolve_model(self) -> str:
        """The first model the server lists when --model was not given (as vLLM does)."""
        if self.model:
            return self.model
        models = await self.models()
        if not models:
            raise BenchError(f"{self.base_url}/models lists no model; pass --model")
        self.model = str(models[0].get("id") or models[0].get("model") or "")
        return self.model

    async def chat(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming chat completion; raises BenchError on any failure."""
        url = f"{self.base_url}/chat/completions"
        body = {"model": self.model, **self.extra_body, **payload}
        try:
            async with self.session.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise BenchError(f"POST {url}: {http_error_message(resp.status, text)}")
                return dict(json.loads(text))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ServerUnreachable(describe_exception(exc, url, self.timeout)) from None
        except ValueError:
            raise BenchError(f"POST {url} did not return JSON") from None

    # ---- measured calls: never raise ------------------------------------------------------

    async def time_models(self) -> float | None:
        """Seconds for a full GET /models answer, or None on failure."""
        start = time.perf_counter()
        try:
            async with self.session.get(f"{self.base_url}/models") as resp:
                await resp.read()
                return time.perf_counter() - start if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError):
            return None

    async def time_first_byte(self, payload: dict[str, Any]) -> float | None:
        """Seconds to the first streamed line of a request, or None on failure."""
        body = {"model": self.model, **self.extra_body, **payload, "stream": True}
        start = time.perf_counter()
        try:
            async with self.session.post(f"{self.base_url}/chat/completions", json=body) as resp:
                if resp.status != 200:
                    await resp.read()
                    return None
                first: float | None = None
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter() - start
                return first
        except (TimeoutError, aiohttp.ClientError):
            return None

    async def stream_chat(
        self,
        payload: dict[str, Any],
        on_chunk: Callable[[RequestRecord], None] | None = None,
        record: RequestRecord | None = None,
    ) -> RequestRecord:
        """Send one streaming chat request and record every chunk's arrival time.

        Pass `record` to keep the partial record of a request that gets cancelled.
        """
        url = f"{self.base_url}/chat/completions"
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
            **payload,
        }
        rec = record if record is not None else RequestRecord()
        rec.start = time.perf_counter()
        try:
            async with self.session.post(url, json=body) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = http_error_message(resp.status, await resp.text())
                    rec.end = time.perf_counter()
                    return rec
                await self._read_stream(resp, rec, on_chunk)
        except asyncio.CancelledError:
            rec.error = rec.error or "cancelled"
            rec.end = time.perf_counter()
            raise
        except Exception as exc:  # every transport failure is recorded, not raised
            rec.error = describe_exception(exc, url, self.timeout)
        rec.end = time.perf_counter()
        if rec.error is None and not rec.done:
            rec.error = f"stream cut after {rec.n_chunks} chunks (no data: [DONE])"
        return rec

    async def _read_stream(
        self,
        resp: aiohttp.ClientResponse,
        rec: RequestRecord,
        on_chunk: Callable[[RequestRecord], None] | None,
    ) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        buffer = ""
        async for raw in resp.content.iter_any():
            now = time.perf_counter()
            buffer += decoder.decode(raw)
            while "\n" in buffer:
                line, buffer = buffer.split("\n", 1)
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if isinstance(chunk, dict) and chunk.get("error"):
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    rec.error = f"error in stream: {str(msg)[:300]}"
                    return
                if isinstance(chunk, dict) and apply_delta(rec, chunk, now) and on_chunk is not None:
                    on_chunk(rec)

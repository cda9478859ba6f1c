"""SCAFFOLDING for testing the harness only: a scripted OpenAI-compatible server with known
timing. Not a model, not part of tokenmill.

Timing model per chat request: `latency` before the response starts, then a prefill of
prompt_tokens / pp_rate seconds (serialised across requests when `serial_prefill`), then one
token every `token_interval` seconds. Token k is due at first_token + k * interval (absolute
deadlines), so scheduling jitter does not accumulate. Tokens are words split by \\w+|[^\\w\\s];
each message adds 4 template tokens and every prompt 2 more.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORDS = [" light", " ray", " prism", " colour", " glass", " lens", " red", " blue"]


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def token_ids(text: str) -> list[int]:
    return [zlib.crc32(t.encode()) % 32000 for t in _TOKEN.findall(text)]


@dataclass
class Reply:
    """What a scripted responder answers: text, or tool calls as (name, arguments)."""

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any] | str]] = field(default_factory=list)


@dataclass
class FakeTiming:
    pp_rate: float = 20000.0
    token_interval: float = 0.005
    latency: float = 0.0
    serial_prefill: bool = False
    token_ids: bool = True
    usage: bool = True
    tokens_per_chunk: int = 1
    fail_status: int | None = None
    fail_every: int = 0  # with fail_status: 0 fails every chat request, N fails every Nth
    cut_after: int | None = None  # end the stream after this many content chunks
    cut_mode: str = "eof"  # "eof": clean end without [DONE]; "abort": drop the connection
    responder: Callable[[dict[str, Any]], Reply] | None = None
    respond_always: bool = False  # the responder answers every chat request, not only those with tools


def prompt_tokens(body: dict[str, Any]) -> int:
    total = 2
    for m in body.get("messages") or []:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        total += 4 + count_tokens(str(content))
    return total


class FakeServer:
    def __init__(self, timing: FakeTiming | None = None) -> None:
        self.timing = timing or FakeTiming()
        self.requests = 0
        self.active = 0
        self.max_active = 0
        self.bodies: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._prefill_lock: asyncio.Lock | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FakeServer:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)

    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._prefill_lock = asyncio.Lock()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        self._loop.run_forever()

    async def _models(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.timing.latency)
        return web.json_response(
            {"object": "list", "data": [{"id": "fake/model", "root": "fake/model", "max_model_len": 131072}]}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        t = self.timing
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return web.json_response({"error": {"message": "messages is required"}}, status=400)
        self.requests += 1
        self.bodies.append(body)
        if t.fail_status and (t.fail_every == 0 or self.requests % t.fail_every == 0):
            await asyncio.sleep(t.latency)
            return web.json_response({"error": {"message": f"scripted failure {t.fail_status}"}}, status=t.fail_status)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._answer(request, body)
        except ConnectionResetError:  # the client went away mid-stream
            return web.Response(status=499)
        finally:
            self.active -= 1

    def _reply(self, body: dict[str, Any]) -> Reply:
        if self.timing.responder is not None and (body.get("tools") is not None or self.timing.respond_always):
            return self.timing.responder(body)
        last = str(body["messages"][-1].get("content") or "")
        if "capital of France" in last:
            return Reply(text="Paris.")
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        return Reply(text="".join(_WORDS[i % len(_WORDS)] for i in range(n)))

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        t = self.timing
        n_prompt = prompt_tokens(body)
        reply = self._reply(body)
        await asyncio.sleep(t.latency)
        stream = bool(body.get("stream"))
        resp: web.StreamResponse | None = None
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
        assert self._prefill_lock is not None
        if t.serial_prefill:
            async with self._prefill_lock:
                await asyncio.sleep(n_prompt / t.pp_rate)
        else:
            await asyncio.sleep(n_prompt / t.pp_rate)
        loop = asyncio.get_running_loop()
        first = loop.time()
        words = re.findall(r"\s*(?:\w+|[^\w\s])", reply.text)  # one server token each
        calls = [(n, a if isinstance(a, str) else json.dumps(a)) for n, a in reply.tool_calls]
        n_out = len(words) if not calls else sum(count_tokens(n) + count_tokens(a) for n, a in calls)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        finish = "tool_calls" if calls else "length"
        if not stream:
            await asyncio.sleep(max(0, n_out - 1) * t.token_interval)
            message: dict[str, Any] = {"role": "assistant", "content": None if calls else reply.text}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                    for i, (n, a) in enumerate(calls)
                ]
            return web.json_response(
                {"id": "fake", "object": "chat.completion", "model": body.get("model"),
                 "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
            )
        assert resp is not None
        want_ids = t.token_ids and bool(body.get("return_token_ids"))
        deltas = _tool_deltas(calls) if calls else [
            ({"content": "".join(words[i : i + t.tokens_per_chunk])}, words[i : i + t.tokens_per_chunk])
            for i in range(0, len(words), t.tokens_per_chunk)
        ]
        k = 0
        for i, (delta, toks) in enumerate(deltas):
            if t.cut_after is not None and i >= t.cut_after:
                if t.cut_mode == "abort":
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write_eof()
                return resp
            await asyncio.sleep(max(0.0, first + k * t.token_interval - loop.time()))
            k += len(toks)
            if i == 0:
                delta = {"role": "assistant", **delta}
            last = i == len(deltas) - 1
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish if last else None}
            if want_ids:
                choice["token_ids"] = token_ids("".join(toks)) or [0] * len(toks)
            chunk: dict[str, Any] = {"id": "fake", "object": "chat.completion.chunk", "choices": [choice]}
            if i == 0 and want_ids:
                chunk["prompt_token_ids"] = [1] * n_prompt
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        opts = body.get("stream_options") or {}
        if t.usage and opts.get("include_usage"):
            await resp.write(f"data: {json.dumps({'id': 'fake', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _tool_deltas(calls: list[tuple[str, str]]) -> list[tuple[dict[str, Any], list[str]]]:
    """Each call streamed as OpenAI does: id and name first, then argument fragments."""
    out: list[tuple[dict[str, Any], list[str]]] = []
    for i, (name, args) in enumerate(calls):
        out.append(({"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function",
                                      "function": {"name": name, "arguments": ""}}]}, [name]))
        half = len(args) // 2
        for frag in (args[:half], args[half:]):
            if frag:
                delta = {"tool_calls": [{"index": i, "function": {"arguments": frag}}]}
                out.append((delta, _TOKEN.findall(frag) or [frag]))
    return out


def main() -> None:
    """Serve in the foreground for manual runs (e.g. real llama-benchy); stops after --lifetime s."""
    import argparse

    p = argparse.ArgumentParser(description="scripted fake OpenAI server (test scaffolding)")
    p.add_argument("--pp-rate", type=float, default=20000.0)
    p.add_argument("--token-interval", type=float, default=0.005)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--lifetime", type=float, default=300.0)
    a = p.parse_args()
    with FakeServer(FakeTiming(pp_rate=a.pp_rate, token_interval=a.token_interval, latency=a.latency)) as s:
        print(s.url, flush=True)
        time.sleep(a.lifetime)


if __name__ == "__main__":
    main()

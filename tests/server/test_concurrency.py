"""64 concurrent streaming clients, one in ten walking away midway."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
ANSWER_TOKENS = 12
LEAVER_TOKENS = 400  # a leaver could never finish during the test: its abort must free it


def _abort_count(server: Any) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("tokenmill:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.split()[-1])
    return 0.0


async def _client(http: httpx.AsyncClient, server: Any, i: int) -> dict[str, Any]:
    leaver = i % 10 == 0
    body = {
        "model": server.state.model_name,
        "messages": [{"role": "user", "content": f"Count from {i} upwards, one number per line."}],
        "max_tokens": LEAVER_TOKENS if leaver else ANSWER_TOKENS, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    result: dict[str, Any] = {"i": i, "leaver": leaver, "chunks": 0, "ids": [], "text": "", "done": False,
                              "finish": None, "usage": None}
    async with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                result["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                result["chunks"] += 1
                result["ids"] += choice.get("token_ids") or []
                result["text"] += choice["delta"].get("content") or ""
                result["finish"] = choice.get("finish_reason") or result["finish"]
            if leaver and result["chunks"] >= 2:
                break  # leaving the context closes the connection mid-stream
    return result


def test_64_streams_with_disconnects(server: Any) -> None:
    aborts_before = _abort_count(server)

    async def run() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as http:
            return await asyncio.gather(*(_client(http, server, i) for i in range(NUM_CLIENTS)))

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    leavers = [r for r in results if r["leaver"]]
    stayers = [r for r in results if not r["leaver"]]
    assert len(leavers) == 7 and len(stayers) == 57
    for r in stayers:
        assert r["done"], r
        assert r["finish"] == "length"
        assert len(r["ids"]) == ANSWER_TOKENS
        assert r["usage"]["completion_tokens"] == ANSWER_TOKENS
        assert r["usage"]["prompt_tokens"] > 0
        assert r["text"]
    for r in leavers:
        assert not r["done"] and r["chunks"] == 2

    # Every leaver was aborted and everything was freed; the server still answers.
    deadline = time.monotonic() + 30
    while True:
        stats = server.engine_stats()
        if (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    assert server.state.engine.num_in_flight == 0
    assert _abort_count(server) - aborts_before >= len(leavers)
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = server.client().chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert resp.usage.completion_tokens <= 3
    print(f"64 streams in {elapsed:.1f}s")


def test_non_streamed_client_disconnect_aborts(server: Any) -> None:
    """A non-streamed request whose client times out is aborted too."""
    aborts_before = _abort_count(server)
    body = {"model": server.state.model_name, "prompt": "Once upon a time", "max_tokens": 2000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=httpx.Timeout(10, read=2))
    deadline = time.monotonic() + 30
    while server.state.engine.num_in_flight or server.engine_stats().kv_blocks_used:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _abort_count(server) - aborts_before == 1

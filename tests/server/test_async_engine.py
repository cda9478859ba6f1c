"""AsyncEngine's threading contract, on a scripted stand-in for LLMEngine (no model needed).

The end-to-end behaviour on the real engine is proven in test_openai_server / test_concurrency;
these tests pin down what is hard to provoke there: idling, crashes, and abort bookkeeping."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import AsyncEngine, ChildRequest, EngineDeadError


class ScriptedEngine:
    """Each request yields max_tokens one-token deltas, one per step()."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.requests: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.threads: set[str] = set()

    def add_request(self, request_id, prompt, params, *, priority=0, cache_salt=None) -> None:
        self.threads.add(threading.current_thread().name)
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        self.requests[request_id] = [params.max_tokens, 0]

    def abort_request(self, request_id: str) -> None:
        self.threads.add(threading.current_thread().name)
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("kernel exploded")
        time.sleep(0.01)
        outputs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outputs.append(RequestOutput(rid, None, [1, 2], [CompletionOutput(
                0, f"t{state[1]} ", [100 + state[1]], finish_reason="length" if done else None)], finished=done))
            if done:
                del self.requests[rid]
        return outputs

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests)}


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def test_fan_out_and_merge() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)

    async def run() -> dict[int, str]:
        stream = await async_engine.submit("r", [ChildRequest([1], params(3)), ChildRequest([1], params(5))])
        texts = {0: "", 1: ""}
        async for index, output in stream:
            texts[index] += output.outputs[0].text
        return texts

    assert asyncio.run(run()) == {0: "t1 t2 t3 ", 1: "t1 t2 t3 t4 t5 "}
    assert engine.threads == {"tokenmill-engine"}  # the engine is only ever touched by its thread
    assert async_engine.num_in_flight == 0
    async_engine.shutdown()


def test_idle_engine_does_not_spin() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1
    assert engine.steps == 0
    async_engine.shutdown()


def test_invalid_request_raises_and_leaves_nothing() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        with pytest.raises(InvalidRequestError):
            await async_engine.submit("r", [ChildRequest([1], params(50)), ChildRequest([], params(5))])

    asyncio.run(run())
    assert engine.aborted == ["r-0"] and not engine.requests
    assert async_engine.num_in_flight == 0
    async_engine.shutdown()


def test_abort_frees_unfinished_children() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        stream = await async_engine.submit("r", [ChildRequest([1], params(2)), ChildRequest([1], params(1000))])
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                stream.abort()
        await async_engine.call(lambda e: None)  # the abort command has run after this

    asyncio.run(run())
    assert engine.aborted == ["r-1"]
    assert not engine.requests and async_engine.num_in_flight == 0
    async_engine.shutdown()


def test_engine_crash_fails_streams_and_health() -> None:
    engine = ScriptedEngine(fail_on_step=2)
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        stream = await async_engine.submit("r", [ChildRequest([1], params(10))])
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await async_engine.submit("s", [ChildRequest([1], params(1))])

    asyncio.run(run())
    assert not async_engine.is_running


def test_call_runs_on_engine_thread() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)
    assert asyncio.run(async_engine.call(lambda e: threading.current_thread().name)) == "tokenmill-engine"
    assert asyncio.run(async_engine.stats()) == {"running": 0}
    async_engine.shutdown()
    assert not async_engine.is_running

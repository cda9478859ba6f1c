"""AsyncEngine's threading contract, on a scripted stand-in for LLMEngine (no model needed).

The end-to-end behaviour on the real engine is proven in test_openai_server / test_concurrency;
these tests pin down what is hard to provoke there: idling, crashes, and abort bookkeeping."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from scripted_engine import ScriptedEngine

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import AsyncEngine, ChildRequest
from tokenmill.server.engine_client import StepFailedError


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
    """A step that raises fails the requests it held; the engine goes on (a fatal crash: test_engine_faults)."""
    engine = ScriptedEngine(fail_on_step=2)
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        stream = await async_engine.submit("r", [ChildRequest([1], params(10))])
        with pytest.raises(StepFailedError):
            async for _ in stream:
                pass
        after = await async_engine.submit("s", [ChildRequest([1], params(1))])
        assert [o.outputs[0].text async for _, o in after] == ["t1 "]

    asyncio.run(run())
    assert async_engine.is_running
    async_engine.shutdown()


def test_call_runs_on_engine_thread() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)
    assert asyncio.run(async_engine.call(lambda e: threading.current_thread().name)) == "tokenmill-engine"
    assert asyncio.run(async_engine.stats()) == {"running": 0}
    async_engine.shutdown()
    assert not async_engine.is_running

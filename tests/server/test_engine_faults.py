"""AsyncEngine when things go wrong, on the scripted stand-in for LLMEngine (no model): failed and
fatal steps, a full waiting queue, deadlines, the drain, and the engine-client protocol."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
from scripted_engine import ScriptedEngine

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from tokenmill.server.engine_client import (
    ChildRequest,
    EngineBusyError,
    EngineClient,
    EngineDeadError,
    RequestCutError,
    RequestTimeoutError,
    StepFailedError,
)


def child(max_tokens: int) -> ChildRequest:
    return ChildRequest([1], SamplingParams(max_tokens=max_tokens))


async def text_of(stream) -> str:
    return "".join([output.outputs[0].text async for _, output in stream])


def test_async_engine_is_an_engine_client() -> None:
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"submit", "abort", "stats", "model_info", "health", "drain", "shutdown"} <= set(members)
    for name in members:
        assert inspect.getattr_static(AsyncEngine, name, None) is not None, name


def test_a_failed_step_fails_only_the_requests_it_held() -> None:
    engine = ScriptedEngine(max_running=1)
    async_engine = AsyncEngine(engine)
    failures = iter([True])
    engine.fail = lambda: next(failures, False) and (_ for _ in ()).throw(RuntimeError("device fault"))

    async def run() -> None:
        held = await async_engine.submit("held", [child(5)])
        waiting = await async_engine.submit("waiting", [child(2)])  # queued behind: not in the step
        with pytest.raises(StepFailedError, match="RuntimeError"):
            await text_of(held)
        assert await text_of(waiting) == "t1 t2 "
        assert await text_of(await async_engine.submit("next", [child(1)])) == "t1 "

    asyncio.run(run())
    assert engine.aborted == ["held-0"]
    assert async_engine.is_running and async_engine.num_in_flight == 0 and async_engine.num_requests == 0
    async_engine.shutdown()


def test_a_failed_step_aborts_the_siblings_of_its_requests() -> None:
    engine = ScriptedEngine(max_running=1)
    async_engine = AsyncEngine(engine)
    engine.fail_on_step = 1

    async def run() -> None:
        stream = await async_engine.submit("r", [child(3), child(3)])  # r-1 waits behind r-0
        with pytest.raises(StepFailedError):
            await text_of(stream)

    asyncio.run(run())
    time.sleep(0.1)
    assert sorted(engine.aborted) == ["r-0", "r-1"] and not engine.has_unfinished_requests()
    async_engine.shutdown()


def test_steps_failing_in_a_row_kill_the_engine() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)
    async_engine.before_step = lambda: (_ for _ in ()).throw(RuntimeError("sticky device fault"))

    async def run() -> None:
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            with pytest.raises(StepFailedError):
                await text_of(await async_engine.submit(f"r{i}", [child(2)]))
        assert async_engine.health().alive
        with pytest.raises(EngineDeadError):
            await text_of(await async_engine.submit("last", [child(2)]))
        with pytest.raises(EngineDeadError):
            await async_engine.submit("after", [child(1)])

    asyncio.run(run())
    assert not async_engine.is_running and not async_engine.health().alive
    assert "in a row" in async_engine.health().detail


@pytest.mark.parametrize("fault", ["recovery", "base_exception"])
def test_what_cannot_be_recovered_kills_the_engine(fault: str) -> None:
    engine = ScriptedEngine()
    if fault == "recovery":
        engine.fail_on_step = 1
        engine.abort_failed_step = lambda: (_ for _ in ()).throw(RuntimeError("bookkeeping broken"))
    else:
        engine.fail = lambda: (_ for _ in ()).throw(SystemExit(3))
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await text_of(await async_engine.submit("r", [child(3)]))

    asyncio.run(run())
    assert not async_engine.is_running


def test_a_submit_racing_the_engine_death_does_not_hang() -> None:
    async_engine = AsyncEngine(ScriptedEngine())
    async_engine.shutdown()

    async def run() -> None:
        async_engine._stopping = False  # pretend the stop had not been seen when submit checked
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(async_engine.submit("late", [child(1)]), 5)

    asyncio.run(run())


def test_a_full_waiting_queue_refuses_with_retry_after() -> None:
    engine = ScriptedEngine(max_running=1, step_seconds=0.02)
    async_engine = AsyncEngine(engine, max_waiting_requests=2)

    async def run() -> list[str]:
        streams = [await async_engine.submit("a", [child(20)])]
        await asyncio.sleep(0.1)  # "a" runs; the queue is empty
        streams.append(await async_engine.submit("b", [child(1)]))
        streams.append(await async_engine.submit("c", [child(1)]))
        with pytest.raises(EngineBusyError, match="--max-waiting-requests 2") as busy:
            await async_engine.submit("d", [child(1)])
        assert busy.value.retry_after >= 1
        with pytest.raises(InvalidRequestError, match="3 sequences"):
            await async_engine.submit("e", [child(1)] * 3)  # could never be queued
        return [await text_of(s) for s in streams]

    assert asyncio.run(run())[1:] == ["t1 ", "t1 "]
    async_engine.shutdown()


def test_a_deadline_aborts_and_frees() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        stream = await async_engine.submit("slow", [child(10_000)], timeout=0.2)
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            await text_of(stream)
        assert time.monotonic() - started < 2
        await async_engine.call(lambda e: None)  # the abort has run after this
        quick = await async_engine.submit("quick", [child(2)], timeout=5)
        assert await text_of(quick) == "t1 t2 "

    asyncio.run(run())
    assert engine.aborted == ["slow-0"] and async_engine.num_in_flight == 0
    async_engine.shutdown()


def test_drain_waits_then_cuts_and_refuses() -> None:
    engine = ScriptedEngine(step_seconds=0.02)
    async_engine = AsyncEngine(engine)

    async def run() -> None:
        short = await async_engine.submit("short", [child(3)])
        long = await async_engine.submit("long", [child(10_000)])
        drained = asyncio.ensure_future(async_engine.drain(0.5))
        assert await text_of(short) == "t1 t2 t3 "
        with pytest.raises(RequestCutError, match="shut down"):
            await text_of(long)
        assert await drained == 1
        with pytest.raises(EngineDeadError, match="shutting down"):
            await async_engine.submit("new", [child(1)])

    asyncio.run(run())
    assert engine.aborted == ["long-0"]
    async_engine.shutdown()


def test_a_clean_drain_cuts_nothing() -> None:
    async_engine = AsyncEngine(ScriptedEngine())

    async def run() -> int:
        stream = await async_engine.submit("r", [child(3)])
        drained = asyncio.ensure_future(async_engine.drain(5))
        await text_of(stream)
        return await drained

    assert asyncio.run(run()) == 0
    async_engine.shutdown()


def test_health_answers_503_once_the_engine_is_dead() -> None:
    """Over HTTP (the stand-in engine behind the real app): failed steps are 500s, the step that
    kills the engine a 503, and /health says 503 from then on (serve exits 70: test_serve_lifecycle)."""
    import httpx
    from server_harness import serve_state

    from tokenmill.server.app import create_state
    from tokenmill.server.engine_client import ModelInfo
    from tokenmill.server.metrics import ServerMetrics

    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)
    async_engine._model_info = ModelInfo("scripted", "scripted", 64, 1000, None)  # it has no checkpoint
    running = serve_state(create_state(async_engine, metrics=ServerMetrics("scripted")), engine)
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        async_engine.before_step = lambda: (_ for _ in ()).throw(RuntimeError("sticky device fault"))
        statuses = [httpx.post(f"{running.base_url}/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code
                    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES)]
        assert statuses == [500] * (MAX_CONSECUTIVE_STEP_FAILURES - 1) + [503]
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "in a row" in health.json()["error"]["message"]
        assert httpx.post(f"{running.base_url}/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 503
    finally:
        running.stop()

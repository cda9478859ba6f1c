"""The real server (SmolLM2, in-process) under big requests, engine faults and deadlines: /health
stays fast while four 5 MB requests are processed, a fault injected into a step fails only that
step's requests, a deadline aborts and frees, and the access log records each request."""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

FIVE_MB = ("The quick brown fox jumps over the lazy dog. " * 120_000)[:5_000_000]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def test_health_stays_fast_while_four_5mb_requests_are_processed(server: Any) -> None:
    """Three rounds of four 5 MB requests at once (chat and completions, each far past the
    context): /health, probed throughout on one connection, keeps its p99 under 100 ms."""
    bodies = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": FIVE_MB}], "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Summarise."},
                                               {"role": "user", "content": FIVE_MB}]}),
        ("/v1/completions", {"prompt": FIVE_MB, "max_tokens": 4}),
        ("/v1/completions", {"prompt": [FIVE_MB[:2_500_000], FIVE_MB[2_500_000:]], "max_tokens": 4}),
    ]
    # Serialized and connected up front: the senders share this process's GIL with the server.
    encoded = [(path, json.dumps(body).encode()) for path, body in bodies]
    senders = [httpx.Client(base_url=server.url, timeout=120) for _ in bodies]
    answers: list[httpx.Response] = []

    def send(client: httpx.Client, path: str, body: bytes) -> None:
        answers.append(client.post(path, content=body, headers={"content-type": "application/json"}))

    with httpx.Client(base_url=server.url, timeout=30) as probe:
        for client in senders:
            assert client.get("/health").status_code == 200
        quiet = []
        for _ in range(20):
            started = time.perf_counter()
            assert probe.get("/health").status_code == 200
            quiet.append(time.perf_counter() - started)
        busy: list[float] = []
        started_all = time.perf_counter()
        for _ in range(3):
            threads = [threading.Thread(target=send, args=(c, *e)) for c, e in zip(senders, encoded)]
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                started = time.perf_counter()
                assert probe.get("/health").status_code == 200
                busy.append(time.perf_counter() - started)
                time.sleep(0.005)
            for thread in threads:
                thread.join()
        elapsed = time.perf_counter() - started_all
    for client in senders:
        client.close()
    print(f"/health: quiet median {statistics.median(quiet) * 1e3:.1f} ms; while 3 x four 5 MB requests ran "
          f"({elapsed:.2f} s): median {statistics.median(busy) * 1e3:.1f} ms, p99 {_p99(busy) * 1e3:.1f} ms, "
          f"max {max(busy) * 1e3:.1f} ms over {len(busy)} probes")
    assert len(busy) >= 30
    assert _p99(busy) < 0.1
    assert len(answers) == 12
    for answer in answers:  # each is far past the context, and says so
        assert answer.status_code == 400, answer.text[:300]
        assert "maximum context length is" in answer.json()["error"]["message"]


def test_a_fault_injected_into_a_step_fails_only_that_steps_requests(server: Any) -> None:
    engine = server.state.engine
    client = server.client()
    model = server.state.model_name
    running = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=300, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = iter(running)
    next(chunks)  # it runs: the next step holds it
    fired = threading.Event()

    def fault() -> None:
        if not fired.is_set():
            fired.set()
            raise RuntimeError("injected device fault")

    engine.before_step = fault
    try:
        with pytest.raises(openai.APIError, match="the engine failed while running this request"):
            for _ in chunks:  # the stream ends with an error event, read as the SDK reads it
                pass
    finally:
        engine.before_step = None
    assert fired.is_set() and engine.is_running
    assert httpx.get(f"{server.url}/health").status_code == 200
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    deadline = time.monotonic() + 10
    while server.engine_stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine_stats().kv_blocks_used == 0


def test_a_fault_during_a_non_streamed_request_is_a_500(server: Any) -> None:
    engine = server.state.engine
    engine.before_step = lambda: (_ for _ in ()).throw(RuntimeError("injected device fault"))
    try:
        with pytest.raises(openai.InternalServerError) as err:
            server.client().completions.create(model=server.state.model_name, prompt="Hello", max_tokens=4)
    finally:
        engine.before_step = None
    assert err.value.status_code == 500 and "RuntimeError" in err.value.message
    assert "Traceback" not in err.value.message and "injected" not in err.value.message  # no internals
    assert server.client().completions.create(model=server.state.model_name, prompt="Hello", max_tokens=2).choices


def test_request_timeout_aborts_and_frees(server: Any) -> None:
    from server_harness import start_server_on

    long = {"model": server.state.model_name, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000}
    with start_server_on(server, request_timeout=1.0) as limited:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as err:
            limited.client().completions.create(**long, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504 and "--request-timeout" in err.value.message
        assert time.monotonic() - started < 10
        with httpx.stream("POST", f"{limited.base_url}/completions", json={**long, "stream": True, "ignore_eos": True},
                          timeout=30) as resp:
            events = [line for line in resp.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 504 and error["type"] == "timeout_error"
        assert len(events) > 3  # it streamed tokens before the deadline
        quick = limited.client().completions.create(model=server.state.model_name, prompt="Hi", max_tokens=2)
        assert quick.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while server.engine_stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine_stats().kv_blocks_used == 0


def test_access_log_has_one_line_per_request(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    from server_harness import start_server_on

    with caplog.at_level(logging.INFO, logger="tokenmill.access"), \
            start_server_on(server, app_options={"access_log": True}) as logged:
        answer = logged.client().chat.completions.create(model=server.state.model_name, messages=QUESTION,
                                                         max_tokens=3)
        streamed = list(logged.client().completions.create(model=server.state.model_name, prompt="Hi",
                                                           max_tokens=2, stream=True))
        httpx.get(f"{logged.url}/v1/models/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.access"]
    assert len(lines) == 3, lines
    usage = answer.usage
    assert f'"POST /v1/chat/completions" 200 prompt_tokens={usage.prompt_tokens} ' \
           f"completion_tokens={usage.completion_tokens} " in lines[0]
    assert '"POST /v1/completions" 200 prompt_tokens=' in lines[1] and streamed
    assert '"GET /v1/models/nope" 404 ' in lines[2] and "tokens" not in lines[2]
    assert all(line.endswith("s") and line.startswith("127.0.0.1:") for line in lines)

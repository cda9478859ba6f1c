"""`tokenmill serve` as a process, through its life: the port checked before the model loads, a
waiting queue bounded with 429 + Retry-After over a tiny KV cache, the access log, a SIGTERM
drain that cuts what outlives --shutdown-timeout (exit status 3), and an engine that cannot step
making the process exit with status 70.

A tiny random model (no tokenizer, so token-id prompts) starts in seconds, and a slowed step
(serve_with_step_hook.py) makes the timing deterministic: each step takes STEP_S or more."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import ServerProcess, spawn_server
from tiny_models import save_tiny_checkpoint

pytestmark = pytest.mark.slow

LAUNCHER = str(Path(__file__).with_name("serve_with_step_hook.py"))
STEP_S = 0.03
PROMPT = list(range(1, 21))  # 20 tokens: 2 blocks; with 40 generated tokens, 4 blocks
GENERATED = 40
KV_BYTES = "160K"  # the tiny model's 512 bytes per token: 20 blocks of 16 tokens, about 5 such requests


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Both servers of the module, started side by side: the slowed one, and one whose every
    step fails."""
    logs = tmp_path_factory.mktemp("serve")
    common = ["--model", str(tiny_model), "--kv-cache-bytes", KV_BYTES]
    plans = {
        "slow": (common + ["--max-waiting-requests", "2", "--shutdown-timeout", "1.5", "--access-log"],
                 [LAUNCHER, "--step-delay", str(STEP_S)]),
        "failing": (common, [LAUNCHER, "--step-fault"]),
    }
    started: dict[str, ServerProcess] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            args, launcher = plans[name]
            started[name] = spawn_server(args, str(logs / f"{name}.log"), launcher=launcher)
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=start, args=(name,)) for name in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for running in started.values():
            if running.proc.poll() is None:
                running.proc.kill()
                running.proc.wait(30)


@pytest.fixture(scope="module")
def proc(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["slow"]


@pytest.fixture(scope="module")
def same_port(proc: ServerProcess, tiny_model: Path) -> subprocess.Popen[str]:
    """A second `tokenmill serve` on the first one's port, started at once so that it runs beside
    the tests before the one that reads its outcome."""
    port = proc.url.rsplit(":", 1)[1]
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_model), "--device",
                             "cpu", "--port", port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_full_queue_answers_429_quickly_and_every_accepted_request_completes(
        proc: ServerProcess, same_port: subprocess.Popen[str]) -> None:
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    results: list[tuple[str, Any, float]] = []
    lock = threading.Lock()

    def request() -> None:
        started = time.monotonic()
        try:
            answer: Any = client.completions.create(model=model, prompt=PROMPT, max_tokens=GENERATED,
                                                    extra_body={"ignore_eos": True})
            outcome = "ok"
        except openai.RateLimitError as error:
            answer, outcome = error, "busy"
        with lock:
            results.append((outcome, answer, time.monotonic() - started))

    threads = [threading.Thread(target=request) for _ in range(20)]  # four times what the KV cache holds
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    ok = [answer for outcome, answer, _ in results if outcome == "ok"]
    busy = [(answer, took) for outcome, answer, took in results if outcome == "busy"]
    assert len(results) == 20 and len(ok) >= 2 and len(busy) >= 5, [(o, t) for o, _, t in results]
    for answer in ok:
        assert answer.usage.completion_tokens == GENERATED and answer.choices[0].finish_reason == "length"
    slowest_ok = GENERATED * STEP_S
    for error, took in busy:
        assert error.status_code == 429 and int(error.response.headers["retry-after"]) >= 1
        assert "--max-waiting-requests 2" in error.message
        assert took < slowest_ok, "refused at once, not after waiting"
    deadline = time.monotonic() + 10
    names = ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_blocks_used")
    while any(_metric(proc.url, n) for n in names):
        assert time.monotonic() < deadline, {n: _metric(proc.url, n) for n in names}
        time.sleep(0.1)
    print(f"{len(ok)} served, {len(busy)} refused with 429 in at most {max(t for _, t in busy):.2f} s")


def test_the_access_log_has_a_line_per_request(proc: ServerProcess) -> None:
    lines = [line for line in proc.log().splitlines() if "tokenmill.access" in line]
    assert any(f'"POST /v1/completions" 200 prompt_tokens={len(PROMPT)} completion_tokens={GENERATED} ' in line
               for line in lines), lines[-5:]
    assert any('"POST /v1/completions" 429 ' in line for line in lines)
    assert any('"GET /v1/models" 200 ' in line for line in lines)


def test_the_port_is_checked_before_the_model_loads(proc: ServerProcess, same_port: subprocess.Popen[str]) -> None:
    _, err = same_port.communicate(timeout=120)
    port = proc.url.rsplit(":", 1)[1]
    assert same_port.returncode == 2, err[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert "KV cache" not in err  # refused before the model was loaded


def _stream(url: str, max_tokens: int, events: list[str]) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        events += [line for line in resp.iter_lines() if line]


def test_sigterm_finishes_what_it_can_and_cuts_the_rest(proc: ServerProcess) -> None:
    """Without a tokenizer a stream is silent until it ends, so the test waits for both requests
    to be running (/metrics) before it sends SIGTERM."""
    short: list[str] = []
    long: list[str] = []
    readers = [threading.Thread(target=_stream, args=(proc.url, 20, short)),  # about 0.6 s
               threading.Thread(target=_stream, args=(proc.url, 200, long))]  # about 6 s
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 30
    while _metric(proc.url, "tokenmill:num_requests_running") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.proc.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(60)
    assert proc.proc.wait(60) == 3  # requests were cut at the deadline
    assert short[-1] == "data: [DONE]"
    assert json.loads(short[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "data: [DONE]"
    error = json.loads(long[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "--shutdown-timeout 1.5" in error["message"]
    log = proc.log()
    assert "SIGTERM: no new connections; 2 requests in flight may finish within 1.5 s" in log
    assert "shutdown deadline: 1 requests cut" in log and "Traceback" not in log


def test_an_engine_that_cannot_step_makes_the_process_exit_70(servers: dict[str, ServerProcess]) -> None:
    proc = servers["failing"]
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    statuses = []
    for _ in range(3):  # MAX_CONSECUTIVE_STEP_FAILURES: each fails its request, the last the engine
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
        statuses.append(err.value.status_code)
    assert statuses == [500, 500, 503]
    assert proc.proc.wait(60) == 70
    log = proc.log()
    assert "the engine died" in log and "exiting with status 70" in log

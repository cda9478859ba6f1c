"""`tokenmill serve` as a real process: flags, API key, priority scheduling, SIGTERM drain."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import ServerProcess, spawn_server

pytestmark = pytest.mark.slow

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    running = spawn_server([
        "--api-key", KEY, "--served-model-name", "smol", "smol-alias", "--max-model-len", "2048",
        "--max-num-seqs", "1", "--scheduling-policy", "priority", "--kv-cache-bytes", "128M",
        "--shutdown-timeout", "60",
    ], str(log))
    yield running
    if running.proc.poll() is None:
        running.proc.kill()
        running.proc.wait(30)


def test_help_lists_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--chat-template", "--tool-call-parser", "--reasoning-parser", "--enable-prefix-caching",
                 "--block-size", "--kv-cache-bytes", "--scheduling-policy", "--shutdown-timeout"):
        assert flag in out, flag
    assert "127.0.0.1" in out and "8000" in out


def test_help_says_each_default_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from tokenmill.cli import build_parser

    monkeypatch.setenv("TOKENMILL_API_KEY", "do-not-print-me")
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = commands.choices["serve"].format_help()
    blocks = re.split(r"\n  (?=-)", text)
    assert len(blocks) > 30
    for block in blocks:
        assert len(re.findall("default:", block, re.IGNORECASE)) <= 1, block
    assert "(default: 127.0.0.1)" in text and "(default: 8388608)" in text and "do-not-print-me" not in text


def test_api_key(proc: ServerProcess) -> None:
    assert httpx.get(f"{proc.url}/v1/models").status_code == 401
    bad = httpx.get(f"{proc.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
    assert httpx.post(f"{proc.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{proc.url}/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{proc.url}/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=KEY, max_retries=0).models.list().data
    assert [m.id for m in models] == ["smol", "smol-alias"]
    assert models[0].model_extra["max_model_len"] == 2048


def test_priority_ordering_under_load(proc: ServerProcess) -> None:
    """One sequence at a time: queued requests run by priority (lower first), not arrival."""
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    finished: list[int] = []
    lock = threading.Lock()

    def request(priority: int) -> None:
        client.completions.create(model="smol-alias", prompt=f"Item {priority}:", max_tokens=2,
                                  extra_body={"priority": priority, "ignore_eos": True})
        with lock:
            finished.append(priority)

    blocker = client.completions.create(model="smol", prompt="Count slowly:", max_tokens=40, stream=True,
                                        extra_body={"ignore_eos": True, "priority": 0})
    first = next(iter(blocker))  # the blocker holds the only slot now
    assert first.choices[0].text is not None
    threads = []
    for priority in (9, 2, 5, 1):  # arrival order differs from priority order
        thread = threading.Thread(target=request, args=(priority,))
        thread.start()
        threads.append(thread)
        time.sleep(0.3)
    rest = list(blocker)
    assert rest[-1].choices[0].finish_reason == "length"
    for thread in threads:
        thread.join(300)
    assert finished == [1, 2, 5, 9]


def test_sigterm_drains_in_flight_requests(proc: ServerProcess) -> None:
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, headers=AUTH, timeout=300) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line:
                events.append(line)
                break
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.get(f"{proc.url}/health", timeout=5)
        events += [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    assert proc.proc.wait(60) == 0
    log = proc.log()
    assert "Traceback" not in log, log[-3000:]



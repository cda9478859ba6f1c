"""End to end against tokenmill's own server with the embedded SmolLM2 on CPU: every mode
produces its table, JSON and PNG; compare prints the Change column for two of our runs and
reads a JSON the real llama-benchy wrote against the same server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.conftest import free_port
from bench.llama_benchy_run import run_llama_benchy

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 300


def server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]


@pytest.fixture(scope="module")
def tokenmill_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(server_command(port), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tokenmill serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tokenmill serve not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def is_png(path: Path) -> bool:
    return path.read_bytes()[:4] == b"\x89PNG"


def test_depth_twice_and_compare(tokenmill_url, bench, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    sweep = ["--pp", 32, "--tg", 4, "--depth", 0, 64, "--concurrency", 1, 2, "--runs", 1]
    rc, stdout, err = bench("depth", "--base-url", tokenmill_url, *sweep, "--save-result", a,
                            "--plot", tmp_path / "depth.png")
    assert rc == 0, err
    assert "pp32 @ d64 (c2)" in stdout and "tg4 (c1)" in stdout and is_png(tmp_path / "depth.png")
    data = json.loads(a.read_text())
    first = data["benchmarks"][0]["requests"][0][0]
    assert first["token_source"] == "ids"  # the server returns token ids per chunk
    assert first["first_response"] == first["first_token"]  # no role-only chunk before prefill
    rc, _, err = bench("depth", "--base-url", tokenmill_url, *sweep, "--skip-coherence", "--save-result", b)
    assert rc == 0, err
    rc, stdout, _ = bench("compare", a, b)
    assert rc == 0
    changes = [line.rsplit("|", 2)[1].strip() for line in stdout.splitlines() if line.startswith("| pp32")]
    assert len(changes) == 4 and all(c.endswith(("better", "worse", "≈")) for c in changes)


def test_serve(tokenmill_url, bench, tmp_path):
    out = tmp_path / "serve.json"
    rc, stdout, err = bench("serve", "--base-url", tokenmill_url, "--num-prompts", 4, "--input-len", 32,
                            "--output-len", 4, "--max-concurrency", 2, "--save-result", out,
                            "--plot", tmp_path / "serve.png")
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert "Serving Benchmark Result" in stdout and r["completed"] == 4 and r["output_lens"] == [4] * 4
    assert r["mean_tpot_ms"] > 0 and is_png(tmp_path / "serve.png")


def test_steady(tokenmill_url, bench, tmp_path):
    out = tmp_path / "steady.json"
    rc, stdout, err = bench("steady", "--base-url", tokenmill_url, "--concurrency", 1, 2, "--input-len", 32,
                            "--output-len", 8, "--warmup", 0.5, "--duration", 2, "--save-result", out,
                            "--plot", tmp_path / "steady.png")
    assert rc == 0, err
    levels = json.loads(out.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["total_tps"]["mean"] > 0 for lv in levels)
    assert "| c2 |" in " ".join(stdout.split()) and is_png(tmp_path / "steady.png")


def test_tools(tokenmill_url, bench, tmp_path):
    out = tmp_path / "tools.json"
    rc, stdout, err = bench("tools", "--base-url", tokenmill_url, "--max-tokens", 24, "--save-result", out)
    assert rc == 0, err  # a 135M model scores low, but every request must succeed
    data = json.loads(out.read_text())
    assert data["scenarios_run"] == 8 and 0 <= data["score"] <= 100 and "score " in stdout


@pytest.mark.skipif(importlib.util.find_spec("llama_benchy") is None, reason="llama-benchy not installed")
def test_llama_benchy_json_from_the_same_server(tokenmill_url, bench, tmp_path):
    theirs, ours = tmp_path / "llama_benchy.json", tmp_path / "ours.json"
    with urllib.request.urlopen(f"{tokenmill_url}/v1/models", timeout=10) as resp:
        model = json.load(resp)["data"][0]["id"]
    proc = run_llama_benchy(f"{tokenmill_url}/v1", theirs, tmp_path / "home",
                            ["--pp", "32", "--tg", "4", "--runs", "1", "--skip-coherence"], model=model)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rc, _, err = bench("depth", "--base-url", tokenmill_url, "--pp", 32, "--tg", 4, "--runs", 1,
                       "--skip-coherence", "--save-result", ours)
    assert rc == 0, err
    rc, stdout, _ = bench("compare", theirs, ours)
    assert rc == 0 and "llama-benchy 0.4.0" in stdout
    assert any(line.startswith("| tg4 ") and line.rstrip("| ").endswith(("better", "worse", "≈"))
               for line in stdout.splitlines())

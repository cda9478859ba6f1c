"""Failures are counted and reported in one clear message, never a traceback."""

from __future__ import annotations

import json

import pytest

from bench.conftest import free_port

QUICK = ["--pp", 32, "--tg", 8, "--runs", 2, "--skip-coherence", "--latency-mode", "none"]


@pytest.mark.parametrize("mode,extra", [
    ("depth", QUICK), ("serve", ["--num-prompts", 2]), ("steady", ["--duration", 0.2, "--warmup", 0]),
    ("tools", []),
])
def test_unreachable_server(bench, mode, extra):
    rc, stdout, err = bench(mode, "--base-url", f"http://127.0.0.1:{free_port()}", *extra)
    assert rc == 2
    assert "error: cannot connect to http://127.0.0.1:" in err and "Is the server running" in err
    assert "Traceback" not in err + stdout


def test_every_request_rejected(fake, bench):
    with fake(fail_status=500) as server:
        rc, stdout, err = bench("depth", "--base-url", server.url, *QUICK)
    assert rc == 2 and "HTTP 500: scripted failure 500" in err and "Traceback" not in err + stdout


def test_some_requests_fail_are_counted(fake, bench, tmp_path):
    out = tmp_path / "depth.json"
    with fake(fail_status=503, fail_every=4, token_interval=0.001) as server:
        rc, stdout, err = bench("depth", "--base-url", server.url, "--no-adapt-prompt", "--concurrency", 2,
                                *QUICK, "--save-result", out)
    assert rc == 1
    assert "1 of 4 requests failed:" in stdout and "x HTTP 503: scripted failure 503" in stdout
    data = json.loads(out.read_text())
    assert data["failures"]["failed"] >= 1 and data["failures"]["requests"] == 4  # warm-up not counted
    assert "Traceback" not in err


def test_bad_request_4xx(fake, bench):
    with fake(fail_status=400, fail_every=1) as server:
        rc, stdout, err = bench("serve", "--base-url", server.url, "--no-adapt-prompt", "--num-warmups", 0,
                                "--num-prompts", 3)
    assert rc == 1
    assert "Failed requests:                         3" in stdout
    assert "3 of 3 requests failed:" in stdout and "3 x HTTP 400: scripted failure 400" in stdout


@pytest.mark.parametrize("cut_mode,message", [
    ("eof", "stream cut after 3 chunks (no data: [DONE])"),
    ("abort", "stream cut: server closed the connection"),
])
def test_stream_cut_midway(fake, bench, cut_mode, message):
    with fake(cut_after=3, cut_mode=cut_mode, token_interval=0.001) as server:
        rc, stdout, err = bench("serve", "--base-url", server.url, "--no-adapt-prompt", "--num-warmups", 0,
                                "--num-prompts", 2, "--output-len", 10)
    assert rc == 1
    assert "2 of 2 requests failed:" in stdout and message in stdout
    assert "Traceback" not in err + stdout


def test_warmup_failure_is_one_line(fake, bench):
    with fake(cut_after=1, token_interval=0.001) as server:
        rc, stdout, err = bench("serve", "--base-url", server.url, "--no-adapt-prompt", "--num-prompts", 2)
    assert rc == 2 and "error: warm-up request failed: stream cut after 1 chunks" in err


def test_bad_arguments_are_messages(bench, fake):
    with fake() as server:
        rc, _, err = bench("serve", "--base-url", server.url, "--goodput", "latency:5")
        assert rc == 2 and "invalid --goodput" in err
        rc, _, err = bench("depth", "--base-url", server.url, "--tokenizer", "/nonexistent/tokenizer.json",
                           "--skip-coherence")
        assert rc == 2 and "cannot load tokenizer" in err
        rc, _, err = bench("tools", "--base-url", server.url, "--only", "nope")
        assert rc == 2 and "unknown scenario" in err

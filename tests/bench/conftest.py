"""Fixtures for the harness tests: a fake server (scaffolding) and an in-process CLI runner."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.fake_server import FakeServer, FakeTiming
from tokenmill.bench.cli import main


@pytest.fixture
def fake() -> Callable[..., contextlib.AbstractContextManager[FakeServer]]:
    @contextlib.contextmanager
    def start(**timing: Any) -> Iterator[FakeServer]:
        with FakeServer(FakeTiming(**timing)) as server:
            yield server

    return start


@pytest.fixture
def bench(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `tokenmill bench ARGS` in-process; returns (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["bench", *map(str, args)])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

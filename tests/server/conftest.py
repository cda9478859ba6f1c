"""One real server per test session: the engine on the embedded SmolLM2 (CPU), served in-process
by uvicorn on a free loopback port, driven over HTTP by the real `openai` client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# The CPU is shared: one intra-op thread avoids OpenMP spin-waiting against other processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from server_harness import RunningServer, start_server


@pytest.fixture(scope="session")
def real_engine() -> Any:
    import torch

    from tokenmill.config import EngineConfig, ParallelConfig
    from tokenmill.engine.engine import LLMEngine

    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(parallel=ParallelConfig(device="cpu")))


@pytest.fixture(scope="session")
def server(real_engine: Any) -> Iterator[RunningServer]:
    running = start_server(real_engine)
    yield running
    running.stop()


@pytest.fixture
def client(server: RunningServer) -> Any:
    return server.client()

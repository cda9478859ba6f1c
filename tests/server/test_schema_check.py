"""The JSON-schema check that large schemas get in a worker process: same verdicts as in-process,
a check past its time refused and the worker replaced."""

from __future__ import annotations

import pytest

from tokenmill.server import schema_check

GOOD = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}}
BAD = {"type": "object", "properties": {"x": {"type": "integer", "minimum": "zero"}}}


@pytest.fixture
def every_schema_in_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema_check, "IN_PROCESS_BYTES", -1)


def test_the_worker_gives_the_in_process_verdicts(every_schema_in_the_worker: None) -> None:
    assert schema_check.schema_problem(GOOD) is None
    in_process = schema_check.schema_problem(BAD)
    assert in_process is not None and "zero" in in_process
    assert schema_check.check_schema(GOOD, 10**6) is None
    assert schema_check.check_schema(BAD, 10**6) == in_process


def test_a_check_past_its_time_is_refused_and_the_worker_replaced(every_schema_in_the_worker: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert schema_check.check_schema(GOOD, 10**6) is None  # the worker is up
    stuck = schema_check._worker()
    monkeypatch.setattr(schema_check, "CHECK_SECONDS", 1e-4)
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "minLength": 1} for i in range(20000)}}
    problem = schema_check.check_schema(huge, 10**6)
    assert problem is not None and problem.startswith("checking it took over")
    monkeypatch.setattr(schema_check, "CHECK_SECONDS", 30.0)
    assert schema_check._worker() is not stuck
    assert schema_check.check_schema(BAD, 10**6) is not None and schema_check.check_schema(GOOD, 10**6) is None

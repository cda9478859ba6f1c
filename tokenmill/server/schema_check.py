"""JSON-schema checks of requests' schemas (response formats, tools), large ones in a process of their own.

jsonschema checks a schema in pure Python: a schema of hundreds of kilobytes takes a second or more,
and a thread doing that holds the interpreter's lock against the engine thread, whose every small
torch call then waits for it (streams stall for about as long as the check). Schemas up to
IN_PROCESS_BYTES are checked in the calling thread (a few milliseconds); larger ones in one spawned
worker process, started on first use, where a check past CHECK_SECONDS is stopped (the worker is
replaced) and refused. This module imports nothing heavy: it is what that process loads.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.process
import multiprocessing
import threading
from typing import Any

IN_PROCESS_BYTES = 16 * 2**10
CHECK_SECONDS = 30.0

_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a usable JSON schema, or None (also when jsonschema is missing)."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema comes with the server's dependencies
        return None
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    except Exception as exc:  # a schema jsonschema cannot even walk (RecursionError, bad $ref, ...)
        return f"{type(exc).__name__}: {exc}"
    return None


def check_schema(schema: Any, size: int) -> str | None:
    """schema_problem, in this thread for a schema of at most IN_PROCESS_BYTES (its JSON size), else in
    the worker process."""
    if size <= IN_PROCESS_BYTES:
        return schema_problem(schema)
    pool = _worker()
    try:
        return pool.submit(schema_problem, schema).result(timeout=CHECK_SECONDS)
    except concurrent.futures.TimeoutError:
        _replace(pool)
        return f"checking it took over {CHECK_SECONDS:g} s"
    except concurrent.futures.process.BrokenProcessPool:
        _replace(pool)
        return "the process checking it stopped"
    except RecursionError:
        return "it is nested too deeply"


def _worker() -> concurrent.futures.ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            atexit.register(_shutdown)
        return _pool


def _shutdown() -> None:
    """Stop the worker before the interpreter tears its modules down (the executor's own clean-up
    runs too late then and reports errors)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _replace(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop `pool`'s worker (a stuck check) so that the next large schema gets a fresh one."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    for process in list(getattr(pool, "_processes", {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)

"""Where `tokenmill serve` spends its start-up, phase by phase, and its time to /health 200.

    python benchmarks/startup_profile.py [--runs 3] [--phases-only] [--] [serve flags ...]

Two measurements:
1. phases (one process): wall seconds of each import and of each start-up function, timed by
   wrapping the functions before the modules that call them are imported (nested phases overlap
   their parents; the table says which is inside which);
2. end to end (`--runs` fresh `tokenmill serve` processes): seconds from spawning the process to
   the first 200 from /health, the figure the issue's target is about; median and all runs.
On the GPU the same script times decode-graph capture and the memory profile as phases.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (label, module, attribute path): start-up functions timed in the phase run; a missing one is skipped.
PHASES: list[tuple[str, str, str]] = [
    ("engine: total", "tokenmill.engine.engine", "LLMEngine.__init__"),
    ("  resolve model", "tokenmill.models.loader", "resolve_model"),
    ("  GGUF header parse", "tokenmill.models.gguf_file", "GGUFCheckpoint.__init__"),
    ("  hf config", "tokenmill.models.loader", "load_hf_config"),
    ("  tokenizer", "tokenmill.models.loader", "load_tokenizer"),
    ("  runner: total", "tokenmill.runner.model_runner", "ModelRunner.__init__"),
    ("    construct model", "tokenmill.runner.model_builder", "_construct"),
    ("    build model (construct + load)", "tokenmill.runner.model_builder", "build_model"),
    ("      read + dequantize tensors", "tokenmill.models.gguf_file", "GGUFCheckpoint.read_tensor"),
    ("    memory profile / KV budget", "tokenmill.runner.memory", "kv_cache_budget"),
    ("    allocate caches", "tokenmill.kv.planner", "allocate_caches"),
    ("    KV scales", "tokenmill.runner.kv_calibration", "configure_kv_scales"),
    ("    capture CUDA graphs", "tokenmill.runner.cuda_graphs", "StepGraphs.capture"),
    ("server: state (templates, parsers)", "tokenmill.server.app", "state_for_engine"),
    ("server: app", "tokenmill.server.app", "build_app"),
]
IMPORTS = ["torch", "tokenmill.config", "transformers", "tokenmill.engine.engine", "tokenmill.server.app",
           "tokenmill.server.serve", "uvicorn"]


def _wrap(totals: dict[str, list[float]], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals.setdefault(label, []).append(time.perf_counter() - start)

    timed.__wrapped__ = fn  # type: ignore[attr-defined]  # marks it wrapped
    return timed


def _install(totals: dict[str, list[float]]) -> None:
    """Wrap every phase function, and rebind the names other loaded tokenmill modules imported it under."""
    for label, module_name, attr in PHASES:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        original = getattr(owner, name, None) if owner is not None else None
        if original is None or hasattr(original, "__wrapped__"):
            continue
        timed = _wrap(totals, label, original)
        setattr(owner, name, timed)
        if path:  # a method: callers find it through the class
            continue
        for module in [m for n, m in sys.modules.items() if n.startswith("tokenmill") and m is not None]:
            for key, value in list(vars(module).items()):
                if value is original:
                    setattr(module, key, timed)


def phase_run(serve_args: list[str]) -> dict[str, Any]:
    """Imports and start-up phases in this process (the model is built, the server not started)."""
    imports: dict[str, float] = {}
    start = time.perf_counter()
    # Leaf modules first, then the rooms above them: each import's own cost.
    for name in ["torch", "tokenmill.config", "transformers", "tokenmill.models.gguf_file", "tokenmill.models.loader",
                 "tokenmill.runner.model_builder", "tokenmill.runner.memory", "tokenmill.kv.planner",
                 "tokenmill.runner.kv_calibration", "tokenmill.runner.cuda_graphs"]:
        before = time.perf_counter()
        importlib.import_module(name)
        imports[name] = time.perf_counter() - before
    for name in ["tokenmill.runner.model_runner", "tokenmill.engine.engine", "tokenmill.server.app",
                 "tokenmill.server.serve", "tokenmill.cli"]:
        before = time.perf_counter()
        importlib.import_module(name)
        imports[name] = time.perf_counter() - before
    totals: dict[str, list[float]] = {}
    _install(totals)
    imported = time.perf_counter() - start

    from tokenmill.cli import build_parser
    from tokenmill.server import serve

    args = build_parser().parse_args(["serve", "--port", str(_free_port()), *serve_args])
    sock = serve.bind_socket(args.host, args.port)
    before = time.perf_counter()
    serve.build_server(args, sock)
    built = time.perf_counter() - before
    sock.close()
    heavy = sorted(m for m in ("triton", "fastapi", "uvicorn", "transformers", "gguf") if m in sys.modules)
    return {"imports": imports, "imports_total": imported, "build_server": built,
            "phases": {label: (len(t), sum(t)) for label, t in totals.items()}, "modules_loaded": heavy}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_health(serve_args: list[str], timeout: float = 600.0) -> float:
    """Seconds from spawning `tokenmill serve` to the first 200 from /health."""
    return _serve_times(serve_args, timeout, first_token=False)[0]


def time_to_first_token(serve_args: list[str], timeout: float = 600.0) -> tuple[float, float, list[str]]:
    """Seconds from spawning `tokenmill serve` to /health 200, and to the first token of a
    completion of 16 prompt token ids (works without a tokenizer: random-weight checkpoints);
    the server's log lines about CUDA graphs and the memory profile."""
    health, first, log = _serve_times(serve_args, timeout, first_token=True)
    return health, first, [line for line in log.splitlines() if "CUDA graph" in line or "memory profile" in line]


def _serve_times(serve_args: list[str], timeout: float, first_token: bool) -> tuple[float, float, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--served-model-name", "m",
               *serve_args]
    log = tempfile.TemporaryFile("w+")  # a pipe left unread would block the server once full
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        health = _wait_for_health(proc, port, start, timeout, log)
        if not first_token:
            return health, health, ""
        body = json.dumps({"model": "m", "prompt": list(range(100, 116)), "max_tokens": 1}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        first = time.perf_counter() - start
        log.seek(0)
        return health, first, log.read()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_for_health(proc: subprocess.Popen, port: int, start: float, timeout: float, log: Any) -> float:
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"tokenmill serve exited with {proc.returncode}: {log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"no /health 200 within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="fresh `tokenmill serve` processes timed to /health 200")
    parser.add_argument("--phases-only", action="store_true", help="skip the end-to-end runs")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="flags for `tokenmill serve` (after --)")
    args = parser.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    if args.phases_only or args.runs == 0:
        result: dict[str, Any] = {}
    else:
        runs = [time_to_health(serve_args) for _ in range(args.runs)]
        result = {"health_s": runs, "health_median_s": statistics.median(runs)}
    # The phase run comes after the end-to-end runs so that their OS file cache state is alike.
    result.update(phase_run(serve_args))
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("\n| import (incremental) | s |\n|---|---:|")
    for name, seconds in result["imports"].items():
        print(f"| {name} | {seconds:.2f} |")
    print(f"| all imports | {result['imports_total']:.2f} |")
    print("\n| start-up phase (indented: inside the one above) | calls | s |\n|---|---:|---:|")
    for label, _, _ in PHASES:
        if label in result["phases"]:
            calls, seconds = result["phases"][label]
            indent = len(label) - len(label.lstrip())
            print(f"| {'&nbsp;' * indent}{label.lstrip()} | {calls} | {seconds:.2f} |")
    print(f"| build_server total | 1 | {result['build_server']:.2f} |")
    print(f"\nheavy modules loaded: {', '.join(result['modules_loaded'])}")
    if "health_s" in result:
        runs_text = ", ".join(f"{s:.2f}" for s in result["health_s"])
        print(f"\n`tokenmill serve {' '.join(serve_args)}` to /health 200: median {result['health_median_s']:.2f} s "
              f"(runs: {runs_text})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

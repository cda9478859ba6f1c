"""llama-benchy (from PyPI) measures the real server offline and fills its pp and tg columns.

llama-benchy downloads a book and a tokenizer; offline it gets the book from its own download
cache (under a temporary HOME, keyed by the URL's md5) and SmolLM2's tokenizer from a local
directory."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

BOOK_URL = "https://example.invalid/tokenmill-test-corpus.txt"  # a cache key only, never fetched


def corpus_text() -> str:
    """Plain English prose that ships with Python: the standard library's docstrings."""
    import argparse
    import collections
    import dataclasses
    import email
    import http.client
    import json as json_mod
    import logging
    import pathlib
    import subprocess as sp
    import threading
    import unittest

    parts = []
    for module in (argparse, collections, dataclasses, email, http.client, json_mod, logging, pathlib, sp,
                   threading, unittest):
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))


def test_llama_benchy_fills_pp_and_tg(server: Any, tmp_path: Path) -> None:
    pytest.importorskip("llama_benchy")
    home = tmp_path / "home"
    cache = home / ".cache" / "llama-benchy"
    cache.mkdir(parents=True)
    text = corpus_text()
    assert len(text) > 50_000
    (cache / f"{hashlib.md5(BOOK_URL.encode()).hexdigest()}.txt").write_text(text, encoding="utf-8")
    tokenizer_dir = tmp_path / "tokenizer"
    server.state.tokenizer.save_pretrained(tokenizer_dir)
    assert (tokenizer_dir / "tokenizer.json").is_file()
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "llama_benchy", "--base-url", server.base_url, "--model", server.state.model_name,
        "--tokenizer", str(tokenizer_dir), "--book-url", BOOK_URL, "--pp", "64", "--tg", "8",
        "--runs", "2", "--concurrency", "1", "2", "--latency-mode", "api", "--skip-coherence",
        "--format", "json", "--save-result", str(out),
    ]
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Error" not in proc.stdout, proc.stdout[-3000:]
    result = json.loads(out.read_text())
    runs = result["benchmarks"]
    assert {b["concurrency"] for b in runs} == {1, 2}
    for bench in runs:
        assert bench["prompt_size"] == 64 and bench["response_size"] == 8
        for column in ("pp_throughput", "tg_throughput"):
            values = bench[column]["values"]
            assert len(values) == 2 and all(v > 0 for v in values), (column, bench)

"""SCAFFOLDING: run the real llama-benchy (pip install llama-benchy==0.4.0) offline against a
server, to produce a JSON in its exact format.

llama-benchy wants a tokenizer and downloads a book; offline, it gets a small BPE tokenizer
trained here on tokenmill's shipped corpus, and the corpus placed in its download cache under
a temporary HOME. `python tests/bench/llama_benchy_run.py URL OUT.json` regenerates the
recorded fixture (tests/bench/fixtures/llama_benchy_0.4.0.json) against any server.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

BOOK_URL = "https://example.invalid/tokenmill-corpus.txt"  # only a cache key, never fetched


def prepare_home(home: Path) -> Path:
    """Write the corpus into llama-benchy's cache and a trained tokenizer; return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tokenmill.bench.corpus import read_corpus_text

    text = read_corpus_text()
    cache = home / ".cache" / "llama-benchy"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"{hashlib.md5(BOOK_URL.encode()).hexdigest()}.txt").write_text(text, encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, show_progress=False))
    path = home / "tokenizer.json"
    tok.save(str(path))
    return path


def run_llama_benchy(url: str, out: Path, home: Path, extra: list[str],
                     model: str = "fake/model") -> subprocess.CompletedProcess[str]:
    tokenizer = prepare_home(home)
    cmd = [sys.executable, "-m", "llama_benchy", "--base-url", url, "--model", model,
           "--tokenizer", str(tokenizer), "--book-url", BOOK_URL, "--format", "json",
           "--save-result", str(out), *extra]
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = run_llama_benchy(sys.argv[1], Path(sys.argv[2]), Path(tmp),
                                ["--pp", "512", "--tg", "32", "--depth", "0", "512", "--concurrency", "1", "2",
                                 "--runs", "2", "--latency-mode", "api"])
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        sys.exit(proc.returncode)

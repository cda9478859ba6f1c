"""Data shipped in the package (a leaf room): the public-domain corpus that benchmarks send and
start-up calibrations read (README.md beside this file says what it is and where it came from)."""

from __future__ import annotations

import gzip
from importlib import resources

CORPUS_FILE = "opticks.txt.gz"


def shipped_corpus_text() -> str:
    """Newton's Opticks, as UTF-8 text."""
    return gzip.decompress(resources.files("tokenmill.data").joinpath(CORPUS_FILE).read_bytes()).decode("utf-8")

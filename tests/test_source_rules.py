"""Rules for the package's source text: each number format's limit is written once (tokenmill.numerics),
and measurements live in benchmarks/RESULTS.md, not in code comments or docstrings."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import tokenmill

PACKAGE = Path(tokenmill.__file__).parent
E4M3_MAX = 448  # the value the rule looks for; the package itself reads it from torch.finfo
MEASURED = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:µs|us|ms|ns|tok/s|tokens/s|GB/s|GiB/s|TB/s|TFLOP/?s|GFLOP/?s)(?!\w)")


def sources() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, path.read_text()


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment block (consecutive comment lines joined) and each docstring."""
    block: list[str] = []
    first = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        if block and token.start[0] != last + 1:
            yield first, " ".join(block)
            block = []
        if not block:
            first = token.start[0]
        block.append(token.string.lstrip("#").strip())
        last = token.start[0]
    if block:
        yield first, " ".join(block)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                yield getattr(node, "lineno", 1), " ".join(docstring.split())


def test_the_e4m3_maximum_is_not_written_as_a_literal() -> None:
    """Kernels read numerics.FP8_E4M3_MAX (as kernels._common.E4M3_MAX, a constexpr)."""
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path, source in sources()
             for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == E4M3_MAX]
    assert not found, "the E4M3 maximum written out; use tokenmill.numerics.FP8_E4M3_MAX:\n" + "\n".join(found)


def test_no_measured_figures_in_comments() -> None:
    """A comment says why a choice was made; the figures that showed it go to benchmarks/RESULTS.md.
    The benchmark front ends (tokenmill/bench) describe what they measure and are exempt."""
    found = [f"{path.relative_to(PACKAGE)}:{line}: {match.group(0)}" for path, source in sources()
             if "bench" not in path.relative_to(PACKAGE).parts
             for line, text in prose(source) for match in MEASURED.finditer(text)]
    assert not found, "measurements in code comments (move them to benchmarks/RESULTS.md):\n" + "\n".join(found)

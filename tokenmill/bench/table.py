"""Markdown pipe tables laid out exactly as tabulate's "pipe" format (llama-benchy's output)."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _pad(text: str, width: int, align: str) -> str:
    gap = " " * (width - _width(text))
    return gap + text if align == "right" else text + gap


def pipe_table(headers: Sequence[str], data: Sequence[Sequence[str]], align: Sequence[str]) -> str:
    widths = [max([_width(h) + 2] + [_width(str(r[i])) for r in data]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(_pad(h, widths[i], align[i]) for i, h in enumerate(headers)) + " |"]
    seps = []
    for i, w in enumerate(widths):
        seps.append(":" + "-" * (w + 1) if align[i] == "left" else "-" * (w + 1) + ":")
    lines.append("|" + "|".join(seps) + "|")
    for r in data:
        lines.append("| " + " | ".join(_pad(str(c), widths[i], align[i]) for i, c in enumerate(r)) + " |")
    return "\n".join(lines)

"""The figures a benchmark script reports: one line each as it is measured, then a markdown
table (and JSON) of them all at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path


class FigureTable:
    def __init__(self, width: int = 58) -> None:
        self.width = width
        self.rows: list[tuple[str, str, str]] = []
        self.figures: dict[str, float] = {}
        self.began = time.perf_counter()

    def report(self, name: str, value: float, unit: str, ceiling: float | None = None, what: str = "") -> None:
        """A figure, with its ratio to `ceiling` (named `what`) when given, else `what` as a note."""
        self.figures[name] = value
        ratio = f"{value / ceiling:.1%} of {what}" if ceiling else what
        self.rows.append((name, f"{value:,.2f} {unit}", ratio))
        print(f"{name:<{self.width}} {value:>12,.2f} {unit:<8} {ratio}", flush=True)

    def finish(self, json_path: Path | None = None) -> None:
        print(f"\n{time.perf_counter() - self.began:.0f} s\n\n| figure | value | ratio |\n|---|---|---|")
        for name, value, ratio in self.rows:
            print(f"| {name.strip()} | {value} | {ratio} |")
        if json_path is not None:
            json_path.write_text(json.dumps(self.figures, indent=2))

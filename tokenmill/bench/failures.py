"""Counting failed requests and summarising them in a few lines."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.record import RequestRecord


@dataclass
class Failures:
    total: int = 0
    by_message: Counter[str] = field(default_factory=Counter)

    def add(self, rec: RequestRecord) -> None:
        self.total += 1
        if rec.error:
            self.by_message[rec.error] += 1

    @property
    def failed(self) -> int:
        return sum(self.by_message.values())

    def summary(self, limit: int = 5) -> str:
        """'' when nothing failed; else one line per distinct error, most common first."""
        if not self.failed:
            return ""
        lines = [f"{self.failed} of {self.total} requests failed:"]
        for msg, n in self.by_message.most_common(limit):
            lines.append(f"  {n} x {msg}")
        if len(self.by_message) > limit:
            lines.append(f"  ... and {len(self.by_message) - limit} other errors")
        return "\n".join(lines)

    def exit_code(self) -> int:
        """Print the summary of failed requests, if any; 1 when some failed, else 0."""
        summary = self.summary()
        if summary:
            print(summary)
        return 1 if summary else 0

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.total, "failed": self.failed, "errors": dict(self.by_message)}

"""Progress bars (tqdm on stderr) that stay quiet when disabled or not on a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, enabled: bool | None = None) -> None:
        # None: tqdm decides (on when stderr is a terminal)
        self.disable = None if enabled is None else not enabled
        self.bar: tqdm | None = None

    def start(self, total: int, desc: str, unit: str = "req") -> None:
        self.close()
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=self.disable, file=sys.stderr, leave=False)

    def describe(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, msg: str) -> None:
        """A status line on stderr that does not break the bar."""
        tqdm.write(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

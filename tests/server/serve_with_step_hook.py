"""`tokenmill serve` with a hook before every engine step (AsyncEngine.before_step), for the
lifecycle tests: `--step-delay S` makes each step take S seconds longer (a slow device, so that
requests are still running when a test needs them to be); `--step-fault` makes every step raise
(a sticky device fault). The remaining arguments are `tokenmill serve`'s.

    python serve_with_step_hook.py [--step-delay S] [--step-fault] serve ARGS...
"""

from __future__ import annotations

import argparse
import sys
import time

import tokenmill.server.app as app
from tokenmill.cli import main
from tokenmill.server.async_engine import AsyncEngine


def hooked_engine_class(delay: float, fault: bool) -> type[AsyncEngine]:
    def before_step() -> None:
        time.sleep(delay)
        if fault:
            raise RuntimeError("injected device fault")

    class HookedAsyncEngine(AsyncEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.before_step = before_step

    return HookedAsyncEngine


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--step-fault", action="store_true")
    ours, rest = parser.parse_known_args()
    app.AsyncEngine = hooked_engine_class(ours.step_delay, ours.step_fault)  # what state_for_engine builds
    sys.exit(main(rest))

"""Errors the harness reports as one clear line instead of a traceback."""

from __future__ import annotations


class BenchError(Exception):
    """A condition that ends a benchmark run; the message is shown to the user as is."""


class ServerUnreachable(BenchError):
    pass


class ResultFormatError(BenchError):
    pass

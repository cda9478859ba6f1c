"""Text from clients, checked at the edge: every string must be valid Unicode, and no error
message quotes more than a short prefix of what a client sent.

JSON can only carry a lone surrogate as a `\\uD800`-`\\uDFFF` escape (raw bytes that are not
UTF-8 fail to parse), so bodies without such an escape skip the walk over the decoded value.
"""

from __future__ import annotations

import re
from typing import Any

MAX_QUOTED = 64  # characters of client text an error message may quote
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def may_hold_surrogates(body: bytes) -> bool:
    return b"\\u" in body and _SURROGATE_ESCAPE.search(body) is not None  # `in` is a fast scan


def lone_surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in `text`, or None when it is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def find_lone_surrogate(value: Any) -> tuple[str, int] | None:
    """(path, index) of the first string in a decoded JSON value that holds a lone surrogate,
    in document order; the path reads like `messages.0.content`, with ` (a key)` when the
    culprit is an object key. Iterative, so any nesting depth is fine."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            index = lone_surrogate_at(node)
            if index is not None:
                return _dotted(path), index
        elif isinstance(node, dict):
            for key, child in reversed(list(node.items())):
                index = lone_surrogate_at(key)
                if index is not None:
                    return f"{_dotted(path)} (a key)", index
                stack.append((child, (*path, key)))
        elif isinstance(node, list):
            stack.extend((node[i], (*path, str(i))) for i in reversed(range(len(node))))
    return None


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(clip(part, 32) for part in path) or "body"


def clip(text: str, limit: int = MAX_QUOTED) -> str:
    """At most `limit` characters of client text, safe to put in a JSON error message."""
    head = text[:limit].encode("utf-8", "replace").decode("utf-8")  # a lone surrogate becomes "?"
    return head if len(text) <= limit else f"{head}... ({len(text)} characters)"

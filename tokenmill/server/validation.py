"""Text from clients, checked at the edge: every string must be valid Unicode, and no error
message quotes more than a short prefix of what a client sent.

A lone surrogate reaches a decoded body two ways: as a `\\uD800`-`\\uDFFF` escape, or as its
three raw bytes (`ED A0 BD`: not UTF-8, but Python's `json.loads(bytes)` decodes them with
`surrogatepass`). `decode_body` turns a body into text the same way and refuses any other bytes
that are not UTF-8; every string decoded from that text then goes through `find_lone_surrogate`.
"""

from __future__ import annotations

from typing import Any

MAX_QUOTED = 64  # characters of client text an error message may quote


class NotUtf8(ValueError):
    """A body whose bytes are not UTF-8 (other than encoded surrogates, which are named later)."""

    def __init__(self, offset: int, byte: int) -> None:
        super().__init__(f"The request body is not valid UTF-8: byte 0x{byte:02x} at offset {offset} "
                         "(JSON text must be sent in UTF-8)")


def decode_body(body: bytes) -> str:
    """The body as text: UTF-8 with an optional BOM, encoded surrogates kept (as `json.loads` keeps
    them) so that the field holding one can be named; any other invalid byte raises NotUtf8."""
    try:
        return body.decode("utf-8-sig", "surrogatepass")
    except UnicodeDecodeError as error:
        raise NotUtf8(error.start, body[error.start]) from None


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

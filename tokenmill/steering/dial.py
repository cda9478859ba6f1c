"""A request's steering strengths, from its `cache_salt` and its `steering` field.

Two ways to ask, one rule for both:

- `cache_salt: "refusal:0.5"` (the reference deployment's convention): a salt of the form
  `<direction>:<number>` for a direction this server steers (or `refusal`, always) is a dial. The
  salt is still the request's cache salt too; any other salt is only a salt.
- `"steering": {"refusal": 0.5}` at the top level of the body (the openai client's `extra_body`
  puts it there): an object of direction -> number.

Both may be given; for the same direction they must agree (else 400: which one is meant is not
guessed). Every strength must be a finite number in [0, --steering-max-strength]; a dial on a
server started without --steering is refused (400), as is an unknown direction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any

from tokenmill.errors import InvalidRequestError

ALWAYS_A_DIAL = "refusal"  # the deployment's dial: refused, not ignored, on a server without steering
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_SALT_DIAL = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*):(?P<value>.*)", re.DOTALL)


class SteeringRequestError(InvalidRequestError):
    """A 400 naming the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _salt_dial(cache_salt: str | None, served: Collection[str]) -> tuple[str, float] | None:
    if cache_salt is None:
        return None
    found = _SALT_DIAL.fullmatch(cache_salt)
    if found is None or (found["name"] not in served and found["name"] != ALWAYS_A_DIAL):
        return None
    name, text = found["name"], found["value"]
    if not _NUMBER.fullmatch(text):
        raise SteeringRequestError(f"cache_salt {_clip(cache_salt)!r} is a steering dial, but {_clip(text)!r} after "
                                   f"'{name}:' is not a number (write e.g. \"{name}:0.5\")", "cache_salt")
    return name, float(text)


def _field_dials(steering: Any) -> dict[str, float]:
    if steering is None:
        return {}
    if not isinstance(steering, dict):
        raise SteeringRequestError(f"steering must be an object of direction -> strength, e.g. "
                                   f"{{\"refusal\": 0.5}}, not {type(steering).__name__}", "steering")
    strengths = {}
    for name, value in steering.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SteeringRequestError(f"steering.{_clip(str(name))} must be a number, not {_clip(repr(value))}",
                                       f"steering.{_clip(str(name))}")
        strengths[name] = float(value)
    return strengths


def request_strengths(cache_salt: str | None, steering: Any, *, served: Collection[str] | None,
                      max_strength: float) -> dict[str, float]:
    """The strength per direction a request asks for ({} when it asks for none). `served`: the
    directions of the server's steering file, None without --steering. Raises SteeringRequestError."""
    names = set(served or ())
    from_salt = _salt_dial(cache_salt, names)
    strengths = _field_dials(steering)
    if from_salt is not None:
        name, value = from_salt
        if name in strengths and strengths[name] != value:
            raise SteeringRequestError(f"cache_salt {_clip(cache_salt or '')!r} asks for {name} strength {value:g} but "
                                       f"steering.{name} is {strengths[name]:g}; give one, or the same value in both",
                                       "steering")
        strengths[name] = value
    if not strengths:
        return {}
    if served is None:
        raise SteeringRequestError(f"this server was started without --steering, so it cannot steer "
                                   f"{', '.join(sorted(_clip(n) for n in strengths))}; drop the dial or start the "
                                   "server with --steering DIR", "steering" if from_salt is None else "cache_salt")
    for name, value in strengths.items():
        param = "cache_salt" if from_salt is not None and from_salt[0] == name and steering is None else f"steering.{name}"
        if name not in names:
            raise SteeringRequestError(f"steering direction {_clip(name)!r} is not served; this server steers "
                                       f"{', '.join(sorted(names))}", param)
        if not math.isfinite(value):
            raise SteeringRequestError(f"steering strength {name} must be a finite number, not {value}", param)
        if not 0 <= value <= max_strength:
            raise SteeringRequestError(f"steering strength {name}={value:g} is outside [0, {max_strength:g}]: 0 is no "
                                       f"steering, 1 full ablation, and this server allows at most {max_strength:g} "
                                       "(--steering-max-strength)", param)
    return strengths


def strength_label(value: float) -> str:
    """A metrics label for a strength: rounded to the nearest 0.25 (a bounded set of values)."""
    return f"{round(value * 4) / 4:g}"

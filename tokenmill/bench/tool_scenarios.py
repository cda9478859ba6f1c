"""tokenmill's own tool-calling scenarios, each scored 2 (right), 1 (partly right) or 0.

Every scenario is one chat request; `score` sees the assistant's text and tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    text: str
    calls: list[tuple[str, str]]  # (function name, raw JSON arguments)
    finish_reason: str | None = None


@dataclass
class Scenario:
    name: str
    what: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    score: Callable[[Answer], tuple[int, str]]
    tool_choice: Any = "auto"
    extra: dict[str, Any] = field(default_factory=dict)


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


WEATHER = _fn("get_weather", "Current weather in a city.", {
    "city": {"type": "string", "description": "City name, e.g. Paris"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
TIME = _fn("get_time", "Current local time in an IANA time zone.", {
    "timezone": {"type": "string", "description": "e.g. Europe/Paris"}}, ["timezone"])
CONVERT = _fn("convert_currency", "Convert an amount of money between currencies.", {
    "amount": {"type": "number"},
    "from_currency": {"type": "string", "description": "ISO 4217 code, e.g. USD"},
    "to_currency": {"type": "string", "description": "ISO 4217 code, e.g. EUR"}},
    ["amount", "from_currency", "to_currency"])
THERMOSTAT = _fn("set_thermostat", "Set the thermostat.", {
    "temperature": {"type": "number"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "mode": {"type": "string", "enum": ["heat", "cool", "auto"]}}, ["temperature", "unit", "mode"])
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, CONVERT, THERMOSTAT)}

_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def parse_args(raw: str) -> dict[str, Any] | None:
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def problems(name: str, raw: str) -> list[str]:
    """What is wrong with a call's arguments against its tool's JSON schema."""
    args = parse_args(raw)
    if args is None:
        return [f"arguments are not a JSON object: {raw[:80]!r}"]
    schema = SCHEMAS.get(name)
    if schema is None:
        return [f"no tool named {name!r}"]
    out = [f"missing {k!r}" for k in schema["required"] if k not in args]
    for k, v in args.items():
        spec = schema["properties"].get(k)
        if spec is None:
            out.append(f"unknown argument {k!r}")
        elif not _TYPES[spec["type"]](v):
            out.append(f"{k!r} should be a {spec['type']}, got {type(v).__name__}")
        elif "enum" in spec and v not in spec["enum"]:
            out.append(f"{k!r}={v!r} not in {spec['enum']}")
    return out


def _names(a: Answer) -> list[str]:
    return [n for n, _ in a.calls]


def _single(a: Answer) -> tuple[int, str]:
    if _names(a) != ["get_weather"]:
        return (1, f"calls {_names(a)}") if "get_weather" in _names(a) else (0, f"calls {_names(a) or 'none'}")
    bad = problems(*a.calls[0])
    args = parse_args(a.calls[0][1]) or {}
    if bad or "paris" not in str(args.get("city", "")).lower():
        return 1, "; ".join(bad) or f"city={args.get('city')!r}"
    return 2, "get_weather(city=Paris)"


def _parallel(a: Answer) -> tuple[int, str]:
    cities = set()
    for name, raw in a.calls:
        city = str((parse_args(raw) or {}).get("city", "")).lower()
        if name == "get_weather" and not problems(name, raw):
            cities |= {c for c in ("paris", "tokyo") if c in city}
    if cities == {"paris", "tokyo"}:
        return (2, "two calls: Paris and Tokyo") if len(a.calls) == 2 else (1, f"{len(a.calls)} calls")
    return (1, f"only {sorted(cities)}") if cities else (0, f"calls {_names(a) or 'none'}")


def _choose(a: Answer) -> tuple[int, str]:
    if "convert_currency" not in _names(a):
        return 0, f"calls {_names(a) or 'none'}"
    raw = dict(a.calls)["convert_currency"]
    args = parse_args(raw) or {}
    ok = (not problems("convert_currency", raw) and args.get("amount") == 250
          and str(args.get("from_currency")).upper() == "USD" and str(args.get("to_currency")).upper() == "EUR")
    if ok and len(a.calls) == 1:
        return 2, "convert_currency(250, USD, EUR)"
    return 1, "; ".join(problems("convert_currency", raw)) or f"arguments {raw[:80]}"


def _no_tool(a: Answer) -> tuple[int, str]:
    if a.calls:
        return 0, f"called {_names(a)} for arithmetic"
    return (2, "answered 144 without a tool") if "144" in a.text else (1, f"no tool, answer {a.text[:60]!r}")


def _types(a: Answer) -> tuple[int, str]:
    if "set_thermostat" not in _names(a):
        return 0, f"calls {_names(a) or 'none'}"
    raw = dict(a.calls)["set_thermostat"]
    bad = problems("set_thermostat", raw)
    args = parse_args(raw) or {}
    if not bad and args.get("temperature") == 21.5 and args.get("unit") == "celsius" and args.get("mode") == "heat":
        return 2, "set_thermostat(21.5, celsius, heat)"
    return 1, "; ".join(bad) or f"arguments {raw[:80]}"


def _multi_turn(a: Answer) -> tuple[int, str]:
    text = a.text.lower()
    if a.calls:
        return 1, "called a tool again instead of answering"
    if ("-3" in text or "minus 3" in text or "−3" in text) and "snow" in text:
        return 2, "used the tool result (-3, snow)"
    return (1, f"answered without the result: {a.text[:60]!r}") if text.strip() else (0, "empty answer")


def _missing(a: Answer) -> tuple[int, str]:
    if not a.calls:
        return 2, "declined: no email tool"
    if any(n != "get_weather" for n in _names(a)):
        return 0, f"invented {_names(a)}"
    return 1, f"called an unrelated tool {_names(a)}"


def _named(a: Answer) -> tuple[int, str]:
    if _names(a) == ["get_time"]:
        bad = problems(*a.calls[0])
        return (1, "; ".join(bad)) if bad else (2, "get_time as forced")
    return (1, f"calls {_names(a)}") if "get_time" in _names(a) else (0, f"calls {_names(a) or 'none'}")


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


SCENARIOS: list[Scenario] = [
    Scenario("single_call", "one call with the right argument",
             _user("What's the weather like in Paris right now? Use celsius."), [WEATHER], _single),
    Scenario("parallel_calls", "two calls in one turn",
             _user("What's the weather in Paris and in Tokyo? Check both cities."), [WEATHER], _parallel,
             extra={"parallel_tool_calls": True}),
    Scenario("choose_tool", "pick the one fitting tool of three",
             _user("How much is 250 US dollars in euros?"), [WEATHER, TIME, CONVERT], _choose),
    Scenario("no_tool_needed", "answer directly when no tool helps",
             _user("What is 12 times 12? Answer with just the number."), [WEATHER, TIME], _no_tool),
    Scenario("argument_types", "number and enum arguments",
             _user("Set the thermostat to 21.5 degrees Celsius in heating mode."), [THERMOSTAT], _types),
    Scenario("multi_turn", "answer from a tool result", [
        {"role": "user", "content": "What's the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": json.dumps({"city": "Oslo", "temperature": -3, "unit": "celsius", "condition": "snow"})},
    ], [WEATHER], _multi_turn),
    Scenario("missing_tool", "decline when no tool fits",
             _user("Send an email to bob@example.com saying hello."), [WEATHER], _missing),
    Scenario("named_tool_choice", "honour tool_choice naming a function",
             _user("Hello!"), [WEATHER, TIME], _named,
             tool_choice={"type": "function", "function": {"name": "get_time"}}),
]

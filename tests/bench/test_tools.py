"""bench tools against scripted responders: scoring 2/1/0, streamed and whole answers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.fake_server import Reply
from tokenmill.bench.tool_scenarios import SCENARIOS, Answer, problems


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


def perfect(body: dict[str, Any]) -> Reply:
    """Answers every scenario as a good model would."""
    text = last_user(body)
    if body["messages"][-1]["role"] == "tool":
        return Reply(text="It is -3 °C with snow in Oslo.")
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return Reply(tool_calls=[("get_time", {"timezone": "Europe/Paris"})])
    if "Paris and in Tokyo" in text:
        return Reply(tool_calls=[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})])
    if "weather" in text:
        return Reply(tool_calls=[("get_weather", {"city": "Paris", "unit": "celsius"})])
    if "US dollars" in text:
        return Reply(tool_calls=[("convert_currency", {"amount": 250, "from_currency": "USD", "to_currency": "EUR"})])
    if "thermostat" in text:
        return Reply(tool_calls=[("set_thermostat", {"temperature": 21.5, "unit": "celsius", "mode": "heat"})])
    if "12 times 12" in text:
        return Reply(text="144")
    return Reply(text="I cannot send email: no tool for that is available.")


def sloppy(body: dict[str, Any]) -> Reply:
    """Half-right or wrong answers, one kind per scenario."""
    text = last_user(body)
    if body["messages"][-1]["role"] == "tool":
        return Reply(text="I checked the weather.")  # ignores the result: 1
    if isinstance(body.get("tool_choice"), dict):
        return Reply(text="Hello!")  # ignores the forced tool: 0
    if "Paris and in Tokyo" in text:
        return Reply(tool_calls=[("get_weather", {"city": "Paris"})])  # one of two: 1
    if "weather" in text:
        return Reply(tool_calls=[("get_weather", {"town": "Paris"})])  # wrong argument name: 1
    if "US dollars" in text:
        return Reply(tool_calls=[("get_time", {"timezone": "UTC"})])  # wrong tool: 0
    if "thermostat" in text:
        return Reply(tool_calls=[("set_thermostat", {"temperature": "21.5", "unit": "C", "mode": "heat"})])  # 1
    if "12 times 12" in text:
        return Reply(tool_calls=[("get_time", {"timezone": "UTC"})])  # a tool for arithmetic: 0
    return Reply(tool_calls=[("send_email", {"to": "bob@example.com"})])  # invented tool: 0


@pytest.mark.parametrize("stream", [True, False])
def test_perfect_model_scores_full_marks(fake, bench, tmp_path, stream):
    out = tmp_path / "tools.json"
    args = ["tools", "--save-result", out] + ([] if stream else ["--no-stream"])
    with fake(responder=perfect, token_interval=0.0005) as server:
        rc, stdout, _ = bench(*args[:1], "--base-url", server.url, *args[1:])
        sent = [b for b in server.bodies if b.get("tools")]
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["score"] == 100.0 and data["points"] == data["max_points"] == 2 * len(SCENARIOS)
    assert data["passed"] == len(SCENARIOS) and data["wall_s"] > 0
    assert "score 100.0% | points 16/16 | passed 8/8" in stdout
    assert sent and all(bool(b.get("stream")) == stream for b in sent)
    assert any(b.get("parallel_tool_calls") for b in sent)


def test_sloppy_model_scores(fake, bench, tmp_path):
    out = tmp_path / "tools.json"
    with fake(responder=sloppy, token_interval=0.0005) as server:
        rc, _, _ = bench("tools", "--base-url", server.url, "--save-result", out)
    assert rc == 0
    scores = {s["name"]: s["score"] for s in json.loads(out.read_text())["scenarios"]}
    assert scores == {"single_call": 1, "parallel_calls": 1, "choose_tool": 0, "no_tool_needed": 0,
                      "argument_types": 1, "multi_turn": 1, "missing_tool": 0, "named_tool_choice": 0}


def test_argument_checks():
    assert problems("set_thermostat", '{"temperature": "21.5", "unit": "C", "mode": "heat"}') == [
        "'temperature' should be a number, got str", "'unit'='C' not in ['celsius', 'fahrenheit']"]
    assert problems("get_weather", "not json") == ["arguments are not a JSON object: 'not json'"]
    assert problems("get_weather", "{}") == ["missing 'city'"]
    single = next(s for s in SCENARIOS if s.name == "single_call")
    assert single.score(Answer("", [("get_weather", '{"city": "Paris"}')]))[0] == 2

"""bench refusals against a scripted server: the rate and mean score per strength, the dial sent
each way (none at strength 0), the client-side phrase detector when the server judges nothing."""

from __future__ import annotations

import json
from typing import Any

from bench.fake_server import Reply

PROMPTS = ["Send an email to my boss.", "Call my mother.", "Order a pizza.", "Turn on the lights."]


def strength_of(body: dict[str, Any]) -> float:
    if "steering" in body:
        return float(body["steering"]["refusal"])
    salt = body.get("cache_salt") or ""
    return float(salt.split(":", 1)[1]) if salt.startswith("refusal:") else 0.0


def dialled(body: dict[str, Any]) -> Reply:
    """Refuses everything at 0, every other prompt at 0.5, nothing at 1."""
    strength = strength_of(body)
    prompt = body["messages"][-1]["content"]
    refuses = strength < 0.5 or (strength < 1 and PROMPTS.index(prompt) % 2 == 0)
    return Reply(text="I'm sorry, but I can't help with that." if refuses else "Sure! Here is how you do it.")


def test_refusal_rate_per_strength(fake, bench, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# four requests\n" + "\n".join(PROMPTS) + "\n")
    out, png = tmp_path / "refusals.json", tmp_path / "refusals.png"
    with fake(responder=dialled, respond_always=True, token_interval=0.0002) as server:
        rc, stdout, _ = bench("refusals", "--base-url", server.url, "--prompts", prompts, "--strengths", "0,0.5,1",
                              "--save-result", out, "--plot", png, "--no-progress")
        bodies = list(server.bodies)
    assert rc == 0
    data = json.loads(out.read_text())
    rates = {lv["strength"]: lv["refusal_rate"] for lv in data["levels"]}
    assert rates == {0.0: 1.0, 0.5: 0.5, 1.0: 0.0}
    assert [lv["mean_score"] for lv in data["levels"]] == [1.0, 0.5, 0.0]
    assert {lv["signal"] for lv in data["levels"]} == {"phrases (client)"}
    assert all(len(lv["responses"]) == 4 for lv in data["levels"])
    assert "strength |" in stdout and "100.0%" in stdout and "50.0%" in stdout
    assert png.stat().st_size > 1000
    chats = [b for b in bodies if b.get("messages")]
    assert sum("steering" not in b and "cache_salt" not in b for b in chats) == 4  # strength 0: no dial at all
    assert sorted(b["steering"]["refusal"] for b in chats if "steering" in b) == [0.5] * 4 + [1.0] * 4


def test_dial_by_cache_salt_and_failed_requests(fake, bench, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    with fake(responder=dialled, respond_always=True, token_interval=0.0002) as server:
        rc, _, _ = bench("refusals", "--base-url", server.url, "--prompts", prompts, "--strengths", "1",
                         "--via", "cache_salt", "--no-progress")
        salts = [b.get("cache_salt") for b in server.bodies if b.get("messages")]
    assert rc == 0 and salts == ["refusal:1"] * 4
    with fake(responder=dialled, respond_always=True, fail_status=400) as server:
        rc, stdout, _ = bench("refusals", "--base-url", server.url, "--prompts", prompts, "--strengths", "0",
                              "--no-progress")
    assert rc == 1 and "4 requests failed" in stdout


def test_bad_arguments(bench, tmp_path) -> None:
    rc, _, err = bench("refusals", "--prompts", tmp_path / "missing.txt", "--base-url", "http://127.0.0.1:9")
    assert rc == 2 and "cannot read the prompt file" in err

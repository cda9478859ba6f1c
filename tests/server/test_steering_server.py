"""Steering over HTTP on the real SmolLM2, through the real openai client: strength 0 answers exactly
as a server without --steering does (log-probabilities, in one batch with requests at other
strengths), the two ways of asking agree, bad dials are 400s with messages, the refusal object and
its counters appear only with the detector on, and prefix-cache blocks are keyed by strength."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_harness import RunningServer, start_server, start_server_on
from steering_files import write_steering_dir

from tokenmill.models.steering_file import DetectorCalibration

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Send an email to my landlord saying the heater is broken."}]
LONG = [{"role": "user", "content": "Tell me about the history of the old city walls, the towers, the gates and the "
                                    "markets of the town, and of the people who built them over many centuries."}]


@pytest.fixture(scope="module")
def steered(real_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SteeringConfig
    from tokenmill.engine.engine import LLMEngine

    calibration = DetectorCalibration(tokens=4, threshold=0.0, scale=1.0, refused_mean=1.0, answered_mean=-1.0)
    directory = write_steering_dir(real_engine, tmp_path_factory.mktemp("steer"), layer=12, calibration=calibration)
    engine = LLMEngine(EngineConfig(model=ModelConfig(max_model_len=2048), parallel=ParallelConfig(device="cpu"),
                                    cache=CacheConfig(kv_cache_bytes=1 << 27),
                                    steering=SteeringConfig(steering=str(directory), steering_max_strength=1.5)))
    running = start_server(engine)
    yield running
    running.stop()


def chat(client: Any, messages: list[dict[str, str]] = ASK, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="", messages=messages, max_tokens=kwargs.pop("max_tokens", 8),
                                          temperature=0, **kwargs)


def run_in_one_step(running: RunningServer, bodies: list[dict[str, Any]]) -> list[Any]:
    """The chat requests, all admitted by the engine between the same two steps (its thread is held
    while they arrive), so two servers given the same bodies batch them alike."""
    gate = threading.Event()

    async def go() -> list[Any]:
        client = running.async_client()
        hold = asyncio.ensure_future(running.state.engine.call(lambda engine: gate.wait(60)))
        await asyncio.sleep(0.2)
        tasks = [asyncio.ensure_future(client.chat.completions.create(model="", temperature=0, **b)) for b in bodies]
        while running.state.engine._commands.qsize() < len(bodies):  # their "add" commands wait behind the hold
            await asyncio.sleep(0.05)
        gate.set()
        await hold
        return list(await asyncio.gather(*tasks))

    return asyncio.run(go())


def test_strength_zero_answers_as_the_unsteered_server(server: RunningServer, steered: RunningServer) -> None:
    prompts = [ASK, LONG, [{"role": "user", "content": "What time is it right now?"}],
               [{"role": "user", "content": "Write a haiku about autumn leaves."}]]
    strengths = [0.0, 1.0, 0.0, 0.5]
    common = dict(max_tokens=12, logprobs=True, top_logprobs=5)
    plain = run_in_one_step(server, [dict(messages=m, **common) for m in prompts])
    ours = run_in_one_step(steered, [dict(messages=m, extra_body={"steering": {"refusal": s}}, **common)
                                     for m, s in zip(prompts, strengths)])
    for strength, a, b in zip(strengths, plain, ours):
        same = a.choices[0].logprobs.model_dump() == b.choices[0].logprobs.model_dump()
        assert same == (strength == 0), strength  # every float equal at strength 0, not otherwise
        if strength == 0:
            assert a.choices[0].message.content == b.choices[0].message.content


def test_cache_salt_and_field_ask_alike(steered: RunningServer) -> None:
    client = steered.client()
    by_salt = chat(client, logprobs=True, top_logprobs=3, extra_body={"cache_salt": "refusal:1"})
    by_field = chat(client, logprobs=True, top_logprobs=3, extra_body={"steering": {"refusal": 1}})
    both = chat(client, logprobs=True, top_logprobs=3, extra_body={"steering": {"refusal": 1.0}, "cache_salt": "refusal:1"})
    unsteered = chat(client, logprobs=True, top_logprobs=3)
    assert by_salt.choices[0].logprobs.model_dump() == by_field.choices[0].logprobs.model_dump()
    assert both.choices[0].logprobs.model_dump() == by_field.choices[0].logprobs.model_dump()
    assert by_field.choices[0].logprobs.model_dump() != unsteered.choices[0].logprobs.model_dump()
    plain_salt = chat(client, extra_body={"cache_salt": "tenant-a"})  # any other salt is only a salt
    assert plain_salt.choices[0].message.content == unsteered.choices[0].message.content


@pytest.mark.parametrize("extra,message,param", [
    ({"steering": {"refusal": 2.0}}, r"outside \[0, 1.5\].*--steering-max-strength", "steering.refusal"),
    ({"steering": {"refusal": -0.1}}, r"outside \[0, 1.5\]", "steering.refusal"),
    ({"steering": {"refusal": "0.5"}}, "must be a number", "steering.refusal"),
    ({"steering": {"refusal": True}}, "must be a number", "steering.refusal"),
    ({"steering": {"honesty": 0.5}}, "'honesty' is not served; this server steers refusal", "steering.honesty"),
    ({"cache_salt": "refusal:2"}, r"outside \[0, 1.5\]", "cache_salt"),
    ({"cache_salt": "refusal:abc"}, "is not a number", "cache_salt"),
    ({"cache_salt": "refusal:nan"}, "is not a number", "cache_salt"),
    ({"cache_salt": "refusal:0.5", "steering": {"refusal": 1}}, "give one, or the same value", "steering"),
])
def test_bad_dials_are_400s(steered: RunningServer, extra: dict[str, Any], message: str, param: str) -> None:
    client = steered.client()
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        chat(client, extra_body=extra)
    assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="", prompt="Hello", max_tokens=2, extra_body=extra)


def test_non_numbers_and_nan_in_the_body(steered: RunningServer) -> None:
    for raw in ('{"steering": {"refusal": NaN}}', '{"steering": {"refusal": Infinity}}', '{"steering": "refusal"}',
                '{"steering": {"refusal": null}}'):
        body = json.dumps({"messages": ASK, "max_tokens": 2})[:-1] + ", " + raw[1:]
        resp = httpx.post(f"{steered.base_url}/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
        assert resp.status_code == 400, raw
        assert "steering" in resp.json()["error"]["message"]
    assert chat(steered.client()).choices[0].finish_reason in ("stop", "length")  # the server goes on


def test_a_dial_on_a_server_without_steering_is_a_400(server: RunningServer) -> None:
    client = server.client()
    for extra in ({"steering": {"refusal": 0.5}}, {"cache_salt": "refusal:0.5"}, {"steering": {"refusal": 0}}):
        with pytest.raises(openai.BadRequestError, match="started without --steering"):
            chat(client, extra_body=extra)
    assert chat(client, extra_body={"steering": {}}).choices[0].message.content  # nothing asked: fine


def test_refusal_objects_only_with_the_detector(server: RunningServer, steered: RunningServer) -> None:
    plain = chat(server.client())
    assert "refusal" not in plain.choices[0].model_extra  # a plain server answers the OpenAI shapes
    assert plain.choices[0].message.refusal is None

    resp = chat(steered.client(), max_tokens=24, extra_body={"steering": {"refusal": 1}})
    refusal = resp.choices[0].model_extra["refusal"]
    assert set(refusal) == {"score", "refused", "signal"} and refusal["signal"] == "direction+phrases"
    assert 0 <= refusal["score"] <= 1 and refusal["refused"] == (refusal["score"] >= 0.5)
    chunks = list(steered.client().chat.completions.create(model="", messages=ASK, max_tokens=6, temperature=0,
                                                           stream=True, n=2))
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 2 and all(set(f.model_extra["refusal"]) == {"score", "refused", "signal"} for f in finals)
    assert all("refusal" not in c.choices[0].model_extra for c in chunks if c.choices and not c.choices[0].finish_reason)
    completion = steered.client().completions.create(model="", prompt="I'm sorry, but", max_tokens=6, temperature=0)
    assert completion.choices[0].model_extra["refusal"]["signal"] == "direction+phrases"

    with start_server_on(server, refusal_detector="on") as phrases:  # no steering file: the phrase list alone
        said = chat(phrases.client(), messages=[{"role": "user", "content": "Say exactly: I'm sorry, but I can't help "
                                                                             "with that."}], max_tokens=16)
        assert said.choices[0].model_extra["refusal"]["signal"] == "phrases"


def test_refusal_counters_by_strength(steered: RunningServer) -> None:
    client = steered.client()
    before = metric_values(steered)
    chat(client, extra_body={"steering": {"refusal": 0.5}})
    chat(client, extra_body={"cache_salt": "refusal:0.5"}, n=2)
    chat(client)
    after = metric_values(steered)
    key = 'tokenmill:refusal_checked_responses_total{model_name="%s",signal="direction+phrases",strength="%s"}'
    name = steered.state.model_name
    assert after[key % (name, "0.5")] - before.get(key % (name, "0.5"), 0) == 3
    assert after[key % (name, "0")] - before.get(key % (name, "0"), 0) == 1
    refused = key.replace("checked", "refused") % (name, "0.5")
    assert refused in after


def metric_values(running: RunningServer) -> dict[str, float]:
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tokenmill:refusal")}


def test_prefix_cache_is_keyed_by_strength(steered: RunningServer) -> None:
    client = steered.client()

    def cached(**extra: Any) -> int:
        details = chat(client, messages=LONG, max_tokens=2, extra_body=extra).usage.prompt_tokens_details
        return details.cached_tokens if details else 0

    assert cached(steering={"refusal": 0.25}) == 0  # not even the system prompt's block: it is keyed by strength
    every_block = cached(steering={"refusal": 0.25})
    assert every_block >= 32  # the same strength shares all its full blocks
    assert cached(steering={"refusal": 0.75}) == 0  # another shares none
    cached()  # unsteered (its first block, the system prompt, may be cached already by earlier requests)
    assert cached(steering={"refusal": 0}) == every_block  # strength 0 is the unsteered computation: it shares it


def test_serve_flags_exist() -> None:
    from tokenmill.cli import build_parser

    args = build_parser().parse_args(["serve", "--steering", "DIR", "--steering-max-strength", "0.5",
                                      "--refusal-detector", "on"])
    assert (args.steering, args.steering_max_strength, args.refusal_detector) == ("DIR", 0.5, "on")

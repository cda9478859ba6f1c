"""Schemathesis fuzzing over the served OpenAPI schema: valid and invalid requests, no 5xx, no hang.

Generation is kept affordable on a CPU: max_tokens, n and list lengths are capped before each
call (the model is real, so every valid request runs it)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import response_schema_conformance

pytestmark = pytest.mark.slow

OPERATIONS = [
    ("POST", "/v1/chat/completions", 110),
    ("POST", "/v1/completions", 90),
    ("POST", "/tokenize", 40),
    ("POST", "/detokenize", 25),
    ("GET", "/v1/models", 3),
    ("GET", "/v1/models/{model_id}", 10),
    ("GET", "/health", 3),
    ("GET", "/version", 3),
    ("GET", "/metrics", 3),
]
MIN_CASES = 500
DEBUG = bool(__import__('os').environ.get('FUZZ_DEBUG'))
_counted: dict[str, int] = {}
_statuses: dict[str, dict[int, int]] = {}


@pytest.fixture(scope="module")
def api_schema(server: Any) -> Any:
    schema_json = httpx.get(f"{server.url}/openapi.json").json()
    return schemathesis.openapi.from_dict(schema_json)


def _cap(body: Any, model: str | None) -> None:
    if not isinstance(body, dict):
        return
    if model is not None and "model" in body:
        body["model"] = model  # (unknown names are a 404 on purpose: test_bad_input covers them)
    def large(value: Any) -> bool:  # JSON numbers: 3054 and 3054.0 are both valid integers
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 2

    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None and key == "max_tokens" or large(value):
            body[key] = 2
    for key in ("n", "best_of", "min_tokens"):
        if large(body.get(key)):
            body[key] = 2
    for key in ("messages", "prompt", "tokens"):
        if isinstance(body.get(key), list):
            body[key] = body[key][:6]
    if isinstance(body.get("prompt"), list):
        body["prompt"] = [p[:64] if isinstance(p, (list, str)) else p for p in body["prompt"]]
    if isinstance(body.get("prompt"), str):
        body["prompt"] = body["prompt"][:256]  # a long text is thousands of tokens of CPU prefill
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = message["content"][:256]


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method,path,examples", OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_fuzz_operation(server: Any, api_schema: Any, method: str, path: str, examples: int, mode: str) -> None:
    if mode == "negative" and method == "GET":
        pytest.skip("nothing to get wrong: no body, and any model id is a valid path")
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    key = f"{mode} {method} {path}"
    _counted[key] = 0

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=strategy)
    def run(case: Any) -> None:
        _cap(case.body, server.state.model_name if mode == "positive" else None)
        response = case.call(base_url=server.url, timeout=120)
        _counted[key] += 1
        tally = _statuses.setdefault(key, {})
        tally[response.status_code] = tally.get(response.status_code, 0) + 1
        if mode == "positive" and response.status_code >= 400 and DEBUG:
            print("##", path, response.text[:300])
        described = f"{method} {path} {json.dumps(case.body, default=str)[:2000]} -> {response.status_code} {response.text[:500]}"
        assert response.status_code < 500, described
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["code"] == response.status_code, described
        elif "application/json" in str(response.headers.get("content-type")):
            case.validate_response(response, checks=[response_schema_conformance])  # the schema is accurate

    run()


def test_fuzz_covered_enough_and_server_healthy(server: Any) -> None:
    """After the whole fuzz run the server is healthy, holds nothing, and still answers correctly."""
    total = sum(_counted.values())
    if not _counted:
        pytest.skip("the fuzz tests did not run in this session")
    print("fuzz cases by status:", _statuses)
    assert total >= MIN_CASES, _counted
    assert httpx.get(f"{server.url}/health").status_code == 200
    stats = server.engine_stats()
    assert stats.num_running == 0 and stats.kv_blocks_used == 0
    answer = server.client().chat.completions.create(
        model=server.state.model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content

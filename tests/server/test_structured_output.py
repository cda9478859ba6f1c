"""StructuredOutputManager on SmolLM2's real vocabulary: masks admit exactly the grammar, and a
decoder that samples random logits under the mask always ends with valid output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenmill.engine.structured_output import StructuredOutputManager
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputSpec as Spec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, len(tokenizer))


def random_decode(manager, tokenizer, spec: Spec, seed: int, max_steps: int = 200) -> str:
    """Sample uniformly-random logits under the grammar mask until the grammar terminates."""
    gen = torch.Generator().manual_seed(seed)
    matcher = manager.new_matcher(spec)
    ids = []
    for _ in range(max_steps):
        mask = matcher.allowed_token_mask()
        assert mask.dtype == torch.bool and mask.shape == (manager.vocab_size,) and mask.any()
        logits = torch.randn(manager.vocab_size, generator=gen)
        token = int(torch.where(mask, logits, torch.tensor(float("-inf"))).argmax())
        matcher.accept_token(token)
        if matcher.is_terminated():
            assert token == tokenizer.eos_token_id
            return tokenizer.decode(ids)
        ids.append(token)
    pytest.fail("the grammar did not terminate")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_always_valid(manager, tokenizer, seed: int) -> None:
    text = random_decode(manager, tokenizer, Spec("json_schema", json.dumps(SCHEMA)), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(2))
def test_regex_and_grammar(manager, tokenizer, seed: int) -> None:
    text = random_decode(manager, tokenizer, Spec("regex", r"(yes|no|maybe)-[0-9]{2}"), seed)
    assert re.fullmatch(r"(yes|no|maybe)-[0-9]{2}", text)
    text = random_decode(manager, tokenizer, Spec("grammar", 'root ::= "a" | "b" "c"'), seed)
    assert text in ("a", "bc")


def test_mask_follows_a_valid_answer(manager, tokenizer) -> None:
    matcher = manager.new_matcher(Spec("json_schema", json.dumps(SCHEMA)))
    answer = '{"city": "Paris", "days": 3, "unit": "celsius"}'
    for token in tokenizer.encode(answer, add_special_tokens=False):
        assert matcher.allowed_token_mask()[token]
        matcher.accept_token(token)
    assert matcher.is_completed() and not matcher.is_terminated()
    mask = matcher.allowed_token_mask()
    assert mask.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    matcher.accept_token(tokenizer.eos_token_id)
    assert matcher.is_terminated()


def test_json_object(manager, tokenizer) -> None:
    matcher = manager.new_matcher(Spec("json_object"))
    assert not matcher.allowed_token_mask()[tokenizer.encode("hello", add_special_tokens=False)[0]]
    for token in tokenizer.encode('{"a": [1, {"b": null}]}', add_special_tokens=False):
        assert matcher.allowed_token_mask()[token]
        matcher.accept_token(token)
    assert matcher.is_completed()


def test_refused_token_terminates_instead_of_raising(manager, tokenizer) -> None:
    matcher = manager.new_matcher(Spec("json_object"))
    matcher.accept_token(tokenizer.encode("hello", add_special_tokens=False)[0])
    assert matcher.is_terminated()


def test_batched_bitmask(manager) -> None:
    a, b = manager.new_matcher(Spec("json_object")), manager.new_matcher(Spec("regex", "[0-9]+"))
    bitmask = manager.allocate_bitmask(2)
    a.fill_bitmask(bitmask, 0)
    b.fill_bitmask(bitmask, 1)
    from tokenmill.engine.structured_output import bitmask_to_bool

    masks = bitmask_to_bool(bitmask, manager.vocab_size)
    assert torch.equal(masks[0], a.allowed_token_mask())
    assert torch.equal(masks[1], b.allowed_token_mask())


@pytest.mark.parametrize("spec", [
    Spec("json_schema", "{not json"),
    Spec("json_schema", '{"type": "nonsense"}'),
    Spec("json_schema", '"just a string"'),
    Spec("json_schema", None),
    Spec("regex", "(unclosed"),
    Spec("grammar", "root ::= "),
    Spec("xml", "<a/>"),
])
def test_invalid_specs_are_request_errors(manager, spec: Spec) -> None:
    with pytest.raises(InvalidRequestError):
        manager.new_matcher(spec)


def test_a_grammar_compiled_ahead_makes_the_same_matcher(manager, tokenizer) -> None:
    """The server compiles on a worker thread and hands the engine the compiled grammar; a matcher
    made from it admits what the manager's own does, and one for another vocabulary is refused."""
    from dataclasses import replace

    from tokenmill.engine.structured_output import matcher_for

    spec = Spec("json_schema", json.dumps(SCHEMA))
    compiled = replace(spec, compiled=manager.compile(spec))
    assert compiled == spec and "compiled" not in repr(compiled)
    ahead, own = matcher_for(compiled.compiled, manager.vocab_size), manager.new_matcher(spec)
    for token in tokenizer.encode('{"city": "Oslo", "days": 2, "unit": "celsius"}', add_special_tokens=False):
        assert torch.equal(ahead.allowed_token_mask(), own.allowed_token_mask())
        ahead.accept_token(token)
        own.accept_token(token)
    assert ahead.is_completed()
    with pytest.raises(ValueError, match="compiled for a vocabulary of"):
        matcher_for(compiled.compiled, manager.vocab_size + 1)

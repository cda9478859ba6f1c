"""A request's steering strengths from cache_salt and the steering field: agreement, conflicts,
ranges, servers without steering; the metrics label buckets."""

from __future__ import annotations

import pytest

from tokenmill.steering.dial import SteeringRequestError, request_strengths, strength_label

SERVED = ("refusal",)


def strengths(salt=None, field=None, served=SERVED, limit=1.0):
    return request_strengths(salt, field, served=served, max_strength=limit)


def test_both_ways_and_plain_salts() -> None:
    assert strengths("refusal:0.5") == {"refusal": 0.5}
    assert strengths(field={"refusal": 1}) == {"refusal": 1.0}
    assert strengths("refusal:.25", {"refusal": 0.25}) == {"refusal": 0.25}  # both, agreeing
    assert strengths("refusal:1e-1") == {"refusal": 0.1}
    assert strengths("tenant-a") == {} and strengths(None, {}) == {} and strengths("refusal-ish:1") == {}
    assert strengths("other:0.5") == {}  # not a served direction: only a salt
    assert strengths("refusal:0") == {"refusal": 0.0}
    assert request_strengths("tenant", None, served=None, max_strength=0) == {}  # no dial: fine anywhere


@pytest.mark.parametrize("salt,field,served,limit,message,param", [
    ("refusal:0.5", {"refusal": 1}, SERVED, 1.0, "give one, or the same value", "steering"),
    ("refusal:abc", None, SERVED, 1.0, "is not a number", "cache_salt"),
    ("refusal:", None, SERVED, 1.0, "is not a number", "cache_salt"),
    ("refusal:inf", None, SERVED, 1.0, "is not a number", "cache_salt"),
    ("refusal:1.5", None, SERVED, 1.0, r"outside \[0, 1\].*--steering-max-strength", "cache_salt"),
    ("refusal:-0.1", None, SERVED, 1.0, r"outside \[0, 1\]", "cache_salt"),
    (None, {"refusal": float("nan")}, SERVED, 1.0, "finite number", "steering.refusal"),
    (None, {"refusal": "0.5"}, SERVED, 1.0, "must be a number", "steering.refusal"),
    (None, {"refusal": False}, SERVED, 1.0, "must be a number", "steering.refusal"),
    (None, ["refusal"], SERVED, 1.0, "must be an object", "steering"),
    (None, {"honesty": 0.5}, SERVED, 1.0, "'honesty' is not served", "steering.honesty"),
    ("refusal:0.5", None, None, 0.0, "started without --steering", "cache_salt"),
    (None, {"refusal": 0}, None, 0.0, "started without --steering", "steering"),
])
def test_refused_dials(salt, field, served, limit, message, param) -> None:
    with pytest.raises(SteeringRequestError, match=message) as caught:
        strengths(salt, field, served, limit)
    assert caught.value.param == param


def test_strength_labels_are_bucketed() -> None:
    assert [strength_label(v) for v in (0, 0.1, 0.125, 0.25, 0.5, 0.6, 1.0, 1.3, 4.0)] == [
        "0", "0", "0", "0.25", "0.5", "0.5", "1", "1.25", "4"]

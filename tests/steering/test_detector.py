"""The refusal detector: F1 on the shipped labelled responses (written for it, refusals and answers
in many styles, hard cases included), and how the direction's signal combines with the phrases."""

from __future__ import annotations

import pytest

from tokenmill.models.steering_file import DetectorCalibration
from tokenmill.steering.detector import RefusalDetector, f1_score, phrase_score, shipped_labelled_responses


def test_f1_on_the_shipped_labelled_set() -> None:
    rows = shipped_labelled_responses()
    assert len(rows) >= 200
    refused = sum(r.refused for r in rows)
    assert 0.3 < refused / len(rows) < 0.7  # both classes well represented
    detector = RefusalDetector()
    predicted = [detector.judge(r.text).refused for r in rows]
    precision, recall, f1 = f1_score([r.refused for r in rows], predicted)
    assert f1 >= 0.9, (precision, recall, f1)


@pytest.mark.parametrize("text,score", [
    ("I'm sorry for any misunderstanding, but as a chatbot, I don't have the ability to send emails.", 1.0),
    ("As an AI language model, I cannot browse the internet.", 1.0),
    ("I must decline this request.", 1.0),
    ('Here is a reply you can send: "Sorry, I can\'t make it tonight."', 0.0),  # quoted: a drafted message
    ("\"I can't do this,\" Mia whispered, then she climbed on.", 0.0),  # quoted speech in a story
    ("I'm sorry to hear that! Here is a recipe for soup.", 0.4),  # an apology alone is weak
    ("The capital of France is Paris.", 0.0),
    ("You cannot divide by zero.", 0.0),
])
def test_phrase_scores(text: str, score: float) -> None:
    assert phrase_score(text) == score


def test_direction_and_phrases_combine() -> None:
    calibration = DetectorCalibration(tokens=4, threshold=0.0, scale=1.0, refused_mean=2.0, answered_mean=-2.0)
    detector = RefusalDetector(calibration)
    high, low = {"refusal": [5.0, 5.0]}, {"refusal": [-5.0, -5.0]}
    weak = "I'm sorry to hear that."
    assert detector.judge(weak, high).refused and not detector.judge(weak, low).refused  # the direction decides weak ones
    assert detector.judge("I can't help with that.", low).refused  # a strong phrase refuses by itself
    assert not detector.judge("Paris.", high).refused  # the direction alone never calls an answer a refusal
    verdict = detector.judge("Paris.", high)
    assert verdict.signal == "direction+phrases" and verdict.score == pytest.approx((0 + 1 / (1 + 2.718281828 ** -5)) / 3)
    assert detector.judge("Paris.", None).signal == "phrases"  # no rows (an empty answer): phrases only
    assert RefusalDetector().judge(weak, high).signal == "phrases"
    assert set(verdict.as_dict()) == {"score", "refused", "signal"}

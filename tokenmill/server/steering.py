"""The server's side of steering: a request's strengths (steering/dial.py), and with the refusal
detector on, each response's `refusal` object (a tokenmill extension field of every choice; in a
stream, of the choice's last chunk) and the detector's Prometheus counters.

The detector is off unless asked for (--refusal-detector on) or a steering file is served
(--refusal-detector auto, the default): a server without either answers exactly the OpenAI
shapes, as vLLM does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.server.protocol import _SamplingFields
from tokenmill.steering.detector import RefusalDetector
from tokenmill.steering.dial import request_strengths, strength_label

if TYPE_CHECKING:
    from tokenmill.server.engine_client import SteeringInfo
    from tokenmill.server.serving import ServerState

DETECTOR_MODES = ("auto", "on", "off")


def make_detector(mode: str, steering: SteeringInfo | None) -> RefusalDetector | None:
    """auto: on with a steering file (its first direction's calibration: direction+phrases), else off."""
    if mode not in DETECTOR_MODES:
        raise ValueError(f"--refusal-detector must be one of {', '.join(DETECTOR_MODES)}, not {mode!r}")
    if mode == "off" or (mode == "auto" and steering is None):
        return None
    if steering is None:
        return RefusalDetector()
    name = steering.directions[0]
    return RefusalDetector(steering.calibrations.get(name), name)


def strengths_of(state: ServerState, req: _SamplingFields) -> dict[str, float]:
    """The request's steering strengths ({} for none); SteeringRequestError (400) for a bad dial."""
    steering = state.steering
    return request_strengths(req.cache_salt, req.steering, served=None if steering is None else steering.directions,
                             max_strength=0.0 if steering is None else steering.max_strength)


def refusal_of(state: ServerState, text: str, projections: dict[str, list[float]] | None,
               strengths: dict[str, float]) -> dict[str, Any] | None:
    """The `refusal` object of one response (None with the detector off), counted in the metrics."""
    detector = state.detector
    if detector is None:
        return None
    verdict = detector.judge(text, projections)
    state.metrics.on_refusal_verdict(strength_label(strengths.get(detector.direction, 0.0)), verdict.signal,
                                     verdict.refused)
    return verdict.as_dict()

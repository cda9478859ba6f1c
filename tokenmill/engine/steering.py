"""A request's steering in the engine: its strengths checked against the served steering file, and
the projections the model records at the rows that sample its first outputs (the refusal
detector's input; layers/steering.py computes them)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from tokenmill.engine.request import Request
from tokenmill.errors import InvalidRequestError
from tokenmill.layers.steering import projection_output
from tokenmill.models.steering_file import SteeringFile

DEFAULT_PROJECTION_TOKENS = 4  # rows recorded per steered direction when its file has no detector calibration


def check_strengths(file: SteeringFile | None, limit: float, steering: Mapping[str, float] | None) -> dict[str, float]:
    """The request's nonzero strengths; InvalidRequestError for any that cannot be served."""
    if not steering:
        return {}
    if file is None:
        raise InvalidRequestError(f"steering {dict(steering)} was asked for, but this engine serves no steering "
                                  "file (start it with --steering DIR)")
    strengths = {}
    for name, value in steering.items():
        if name not in file.directions:
            raise InvalidRequestError(f"steering direction {name!r} is not served; the steering file has "
                                      f"{', '.join(file.directions)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(f"steering strength {name!r} must be a finite number, not {value!r}")
        if not 0 <= value <= limit:
            raise InvalidRequestError(f"steering strength {name!r} = {value:g} is outside [0, {limit:g}] "
                                      "(--steering-max-strength)")
        if value:
            strengths[name] = float(value)
    return strengths


def record_projections(request: Request, file: SteeringFile, host_outputs: Mapping[str, torch.Tensor], row: int) -> None:
    """Each direction's projection at `row` (the request's sampling row of a resolved step), when it
    sampled output n for n below the detector's window (a row recomputed after preemption is
    recorded once)."""
    n = len(request.output_token_ids)
    for name, direction in file.directions.items():
        window = direction.calibration.tokens if direction.calibration else DEFAULT_PROJECTION_TOKENS
        recorded = request.direction_projections.setdefault(name, [])
        if n == len(recorded) < window:
            recorded.append(float(host_outputs[projection_output(name)][row]))

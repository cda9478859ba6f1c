"""Steering files for tests: a random unit direction for an engine's own model (identity included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmill.models.steering_file import (
    DetectorCalibration,
    SteeringDirection,
    SteeringFile,
    model_identity,
    save_steering_file,
)


def random_direction(hidden: int, seed: int = 0) -> torch.Tensor:
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return vector / vector.norm()


def steering_file_for(engine: Any, layer: int = 1, seed: int = 0, name: str = "refusal",
                      calibration: DetectorCalibration | None = None) -> SteeringFile:
    """A file for `engine`'s model (an LLMEngine) with a random direction probed at `layer`."""
    identity = model_identity(engine.runner.model, engine.hf_config, engine.model_name)
    direction = SteeringDirection(name, layer, random_direction(engine.hf_config.hidden_size, seed), calibration,
                                  {"positions": "test", "normalization": "unit L2"})
    return SteeringFile(identity, {name: direction})


def write_steering_dir(engine: Any, directory: Path, **kwargs: Any) -> Path:
    return save_steering_file(directory, steering_file_for(engine, **kwargs))

"""The steering file: the directions a model's residual stream is steered along, and what built them.

A directory of two files, written by `tokenmill steer build` and read by `tokenmill serve --steering DIR`:

- `directions.safetensors`: per direction name one float64 unit vector [hidden_size] (the
  difference of means it came from, normalised), and `<name>.candidates` [layers, hidden_size],
  every layer's direction for inspection;
- `steering.json`: {"format": "tokenmill-steering/1", "model": {name, architecture, hidden_size,
  num_layers, fingerprint}, "directions": {name: {"layer", "positions", "normalization",
  "ablation", "detector": {tokens, threshold, scale, refused_mean, answered_mean}, "scores"}},
  "build": {...}}.

A file serves only the model it was built from: architecture, shape and a fingerprint of the
embedding weights must match, else start-up fails (a direction of another model means nothing).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.steering import ResidualSteering

FORMAT = "tokenmill-steering/1"
TENSORS = "directions.safetensors"
METADATA = "steering.json"
FINGERPRINT_ROWS = 64


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    architecture: str
    hidden_size: int
    num_layers: int
    fingerprint: str  # sha256 of the first embedding rows in bfloat16: the same checkpoint in any dtype


@dataclass(frozen=True)
class DetectorCalibration:
    """How the refusal detector reads a response's mean projection p over its first `tokens` rows:
    direction score sigmoid((p - threshold) / scale), from the build's responses at strength 0."""

    tokens: int
    threshold: float
    scale: float
    refused_mean: float
    answered_mean: float


@dataclass(frozen=True)
class SteeringDirection:
    name: str
    layer: int  # the layer whose input stream it was computed at (and is probed at)
    vector: torch.Tensor  # [hidden] float64, unit length
    calibration: DetectorCalibration | None = None
    info: dict[str, Any] = field(default_factory=dict)  # positions, normalization, scores, ...


@dataclass(frozen=True)
class SteeringFile:
    model: ModelIdentity
    directions: dict[str, SteeringDirection]
    build: dict[str, Any] = field(default_factory=dict)
    candidates: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [layers, hidden]
    path: str | None = None


def model_identity(model: nn.Module, hf_config: Any, name: str) -> ModelIdentity:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ConfigError(f"{type(model).__name__} has no embedding table to fingerprint for steering")
    rows = embedding.weight.detach()[:FINGERPRINT_ROWS].to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:32]
    architecture = (getattr(hf_config, "architectures", None) or [type(model).__name__])[0]
    return ModelIdentity(name, architecture, int(hf_config.hidden_size), int(hf_config.num_hidden_layers),
                         f"sha256:{digest}")


def check_model(file: SteeringFile, identity: ModelIdentity) -> None:
    built = file.model
    for what in ("architecture", "hidden_size", "num_layers", "fingerprint"):
        if getattr(built, what) != getattr(identity, what):
            raise ConfigError(
                f"the steering file {file.path or ''} was built for another model ({built.name}: {what} "
                f"{getattr(built, what)}; this model has {getattr(identity, what)}); build one for this model with "
                f"`tokenmill steer build --model ...`")


def steering_module(file: SteeringFile, num_layers: int, use_triton: bool, device: torch.device) -> ResidualSteering:
    """The residual-steering layer of a file's (single) direction."""
    if len(file.directions) != 1:
        raise ConfigError(f"a steering file with {len(file.directions)} directions ({', '.join(file.directions)}); "
                          "tokenmill serves one direction at a time")
    direction = next(iter(file.directions.values()))
    return ResidualSteering(direction.name, direction.vector.float(), direction.layer, num_layers, use_triton).to(device)


def save_steering_file(directory: str | Path, file: SteeringFile) -> Path:
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: d.vector.to(torch.float64).contiguous() for name, d in file.directions.items()}
    tensors.update({f"{name}.candidates": t.to(torch.float64).contiguous() for name, t in file.candidates.items()})
    save_file(tensors, str(out / TENSORS))
    directions = {
        name: {"layer": d.layer, **d.info, "detector": None if d.calibration is None else asdict(d.calibration)}
        for name, d in file.directions.items()
    }
    meta = {"format": FORMAT, "model": asdict(file.model), "directions": directions, "build": file.build}
    (out / METADATA).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_steering_file(directory: str | Path) -> SteeringFile:
    """Read and check a steering directory; ConfigError names what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    if not (path / METADATA).is_file() or not (path / TENSORS).is_file():
        raise ConfigError(f"--steering {directory}: not a steering directory (it needs {METADATA} and {TENSORS}; "
                          "write one with `tokenmill steer build --out DIR`)")
    try:
        meta = json.loads((path / METADATA).read_text())
        tensors = load_file(str(path / TENSORS))
    except (ValueError, OSError, SafetensorError) as error:
        raise ConfigError(f"--steering {directory}: cannot read it: {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"--steering {directory}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                          f"expected {FORMAT!r}")
    try:
        model = ModelIdentity(**meta["model"])
        directions = {}
        for name, entry in meta["directions"].items():
            entry = dict(entry)
            layer = int(entry.pop("layer"))
            detector = entry.pop("detector", None)
            vector = tensors[name].to(torch.float64)
            directions[name] = SteeringDirection(name, layer, vector,
                                                 DetectorCalibration(**detector) if detector else None, entry)
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"--steering {directory}: {METADATA} is incomplete or malformed ({type(error).__name__}: "
                          f"{error})") from None
    for name, d in directions.items():
        norm = float(d.vector.norm())
        if d.vector.shape != (model.hidden_size,) or not math.isfinite(norm) or abs(norm - 1) > 1e-6:
            raise ConfigError(f"--steering {directory}: direction {name!r} must be a finite unit vector of "
                              f"{model.hidden_size} values (shape {tuple(d.vector.shape)}, |r| = {norm:.6g})")
        if not 0 <= d.layer < model.num_layers:
            raise ConfigError(f"--steering {directory}: direction {name!r} names layer {d.layer} of {model.num_layers}")
        calibration = d.calibration
        if calibration is not None and not (calibration.tokens >= 1 and calibration.scale > 0):
            raise ConfigError(f"--steering {directory}: direction {name!r} has a detector calibration with "
                              f"tokens {calibration.tokens} and scale {calibration.scale} (need >= 1 and > 0)")
    candidates = {k.removesuffix(".candidates"): v for k, v in tensors.items() if k.endswith(".candidates")}
    return SteeringFile(model, directions, meta.get("build", {}), candidates, str(path))

"""Per-request steering of the residual stream: directional ablation of every write into it.

Formulation. A decoder's residual stream is the sum of its writes: the token embedding, then each
attention output and each MLP output. With a unit direction r (float32) and a per-request
strength lam, every write w of that request's tokens (prompt and generated alike) becomes

    w' = w - lam (w . r) r

before it is added to the stream (Arditi et al. 2024; at lam = 1 this is their directional
ablation, the same as weights (I - r r^T) W: no component along r ever enters the stream). For any
lam the stream's component along r is (1 - lam) times the sum of the writes' components (the
writes themselves follow the steered stream); lam > 1 pushes the stream against r. The product
is taken in float32 and w' rounded to the model dtype once; where lam == 0 the write is selected
as it was, bit for bit, so a request at strength 0 computes exactly what an unsteered server does,
whatever the other rows of its batch do.

The seam. A model that supports steering (`CausalLM.set_residual_steering`) makes one
`SteeringStep` per forward (`ResidualSteering.step(ctx)`) and routes each residual add through
`residual_add_norm`: on CUDA one Triton kernel ablates the write, adds it and normalises (no
extra launch); the PyTorch reference ablates with torch ops and calls the norm. The step also
records, at the direction's layer, the projection of the stream entering that layer on r, per
token (`StepContext.outputs`), which the refusal detector reads for the rows that sample the first
generated tokens. Strengths are a per-request input of the step context (one float32 per request,
`StepContext.request_inputs`; padding rows of CUDA graphs hold 0) read per token through
`token_rows`, so captured graphs replay for any mix of strengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.step_context import RequestInputSpec, StepContext


def strength_input(name: str) -> str:
    """The request input that carries a direction's per-request strength."""
    return f"steering.{name}"


def projection_output(name: str) -> str:
    """The per-token output holding the stream's projection on a direction at its layer."""
    return f"steering.{name}.projection"


class ResidualSteering(nn.Module):
    """One named unit direction, ablated from every residual write with per-request strengths, and
    probed at `layer` (the layer whose input the direction was computed at)."""

    def __init__(self, name: str, direction: torch.Tensor, layer: int, num_layers: int, use_triton: bool) -> None:
        super().__init__()
        self.name = name
        self.num_layers = num_layers
        self.use_triton = use_triton
        self.register_buffer("direction", torch.zeros(direction.shape[-1], dtype=torch.float32), persistent=False)
        self.layer = 0
        self.set_direction(direction, layer)

    def set_direction(self, direction: torch.Tensor, layer: int) -> None:
        """Replace the direction in place (captured CUDA graphs read the same buffer; `layer` is read
        when a forward is traced, so change it only where nothing is captured)."""
        if direction.dim() != 1 or direction.shape[0] != self.direction.shape[0]:
            raise ConfigError(f"a steering direction of shape {tuple(direction.shape)} for a hidden size of "
                              f"{self.direction.shape[0]}")
        norm = float(direction.double().norm())
        if not torch.isfinite(direction).all() or abs(norm - 1.0) > 1e-4:
            raise ConfigError(f"the steering direction {self.name!r} must be finite and of unit length (|r| = {norm:.6g})")
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"the steering direction's layer {layer} is not one of the model's {self.num_layers} layers")
        self.direction.copy_(direction.to(torch.float32))
        self.layer = layer

    def request_inputs(self) -> dict[str, RequestInputSpec]:
        return {strength_input(self.name): RequestInputSpec((), torch.float32, 0.0)}

    def token_outputs(self) -> tuple[str, ...]:
        return (projection_output(self.name),)

    def step(self, ctx: StepContext) -> SteeringStep | None:
        """This forward's steering; None when the step carries no strengths (the runner's internal
        forwards: memory profile, KV-scale calibration), which then run unsteered."""
        strengths = ctx.request_inputs.get(strength_input(self.name))
        if strengths is None:
            return None
        rows = ctx.token_rows
        if rows is None:
            qsl = ctx.attention.query_start_loc.long()
            rows = torch.searchsorted(qsl[1:], torch.arange(ctx.num_tokens, device=qsl.device), right=True)
        return SteeringStep(self, ctx, strengths, rows[: ctx.num_tokens])


@dataclass
class SteeringStep:
    steering: ResidualSteering
    ctx: StepContext
    strengths: torch.Tensor  # [B] float32
    token_rows: torch.Tensor  # [T] int64
    _coefficients: torch.Tensor | None = None

    @property
    def layer(self) -> int:
        return self.steering.layer

    @property
    def coefficients(self) -> torch.Tensor:
        """[T, 1] float32: each token's request strength."""
        if self._coefficients is None:
            self._coefficients = self.strengths.to(torch.float32)[self.token_rows].unsqueeze(-1)
        return self._coefficients

    def ablate(self, x: torch.Tensor) -> torch.Tensor:
        """A write [T, H] with lam (x . r) r removed per token (the reference op)."""
        r = self.steering.direction
        c = self.coefficients
        xf = x.float()
        steered = (xf - (c * (xf @ r).unsqueeze(-1)) * r).to(x.dtype)
        return torch.where(c != 0, steered, x)

    def add_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                 probe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(stream), stream) with stream = ablate(x) + residual (or ablate(x) alone at the
        first layer); `probe` records stream . r per token."""
        if self.steering.use_triton and type(norm) is RMSNorm:
            from tokenmill.kernels.rms_norm import steered_add_rms_norm

            projection = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if probe else None
            normed, stream = steered_add_rms_norm(x, residual, norm.weight, norm.eps, self.steering.direction,
                                                  self.strengths, self.token_rows, projection)
            if projection is not None:
                self.ctx.outputs[projection_output(self.steering.name)] = projection
            return normed, stream
        x = self.ablate(x)
        if residual is None:
            normed, stream = norm(x), x
        else:
            normed, stream = norm(x, residual)
        if probe:
            self.ctx.outputs[projection_output(self.steering.name)] = stream.float() @ self.steering.direction
        return normed, stream

    def stream(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The stream a layer reads, from its last write not yet added (for `keep_hidden`)."""
        x = self.ablate(x)
        return x if residual is None else x + residual


def residual_add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, steer: SteeringStep | None,
                      probe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A write `x` added to the stream and normalised: (norm(stream), stream); `residual` None at the
    first layer (the write is the embedding). With `steer`, the write is ablated first."""
    if steer is not None:
        return steer.add_norm(norm, x, residual, probe)
    if residual is None:
        return norm(x), x
    return norm(x, residual)

"""GPTQ (Frantar et al., 2022): a layer's weight rounded one input column at a time, each
column's rounding error spread over the columns not yet rounded through the inverse Hessian of
the layer's inputs, H = Σ xᵀx over the calibration tokens, so that X·Wᵀ moves as little as the
format allows. The format decides the values (its encoder's GroupRounding); the encoder then
writes the rounded weight under exactly the scales used, so the file is an ordinary checkpoint
of its format.

Act-order with static groups (AutoGPTQ's `desc_act` + `static_groups`): every group's scales are
fixed first from the weight as it is, then the columns are walked by decreasing diag(H), the
inputs that matter most first (benchmarks/RESULTS.md has it against the in-order walk, whose
scales follow the walk); the lazy batch update of the paper, blocks of BLOCK columns; dampening
DAMP × the mean of diag(H); inputs calibration never saw (diag 0) get a unit diagonal.
"""

from __future__ import annotations

import torch

from tokenmill.quantization.encoding import GroupRounding

BLOCK = 128
DAMP = 0.01


class HessianSum:
    """Σ xᵀx of the inputs of each layer (float64), by model module path."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def note(self, path: str, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        if path in self.sums:
            self.sums[path].addmm_(rows.T, rows)
        else:
            self.sums[path] = rows.T @ rows


def inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of H⁻¹ after dampening (float32), as the GPTQ update reads it."""
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(DAMP * torch.diagonal(h).mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, rounding: GroupRounding) -> torch.Tensor:
    """weight [N, K] float32 rounded by GPTQ under `rounding`; returns the rounded values
    (dequantized float32 [N, K]; rounding.fixed() then holds the scales they sit on)."""
    rows, columns = weight.shape
    group = rounding.group
    if columns % group:
        raise ValueError(f"GPTQ rounds whole groups of {group} columns; K = {columns}")
    for index in range(columns // group):
        rounding.start_group(index, weight[:, index * group:(index + 1) * group].float())
    order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True).to(weight.device)
    factor = inverse_hessian_factor(hessian[order][:, order]).to(weight.device)
    w = weight.float()[:, order].clone()
    rounded = torch.empty_like(w)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = w[:, start:end]
        errors = torch.empty_like(block)
        inv = factor[start:end, start:end]
        for i in range(end - start):
            q = rounding.round(int(order[start + i]) // group, block[:, i])
            rounded[:, start + i] = q
            error = (block[:, i] - q) / inv[i, i]
            block[:, i:] -= error[:, None] * inv[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ factor[start:end, end:]
    return rounded[:, torch.argsort(order)]

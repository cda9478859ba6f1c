"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ConfigError


class RMSNorm(nn.Module):
    """`forward(x)` -> norm(x); `forward(x, residual)` -> (norm(x + residual), x + residual).

    The reference computes in float32 exactly as Hugging Face's Llama does; `use_triton` uses the
    Triton kernel, one pass over memory (CUDA only).
    """

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = use_triton

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            from tokenmill.kernels.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), the weight zero-initialised (Qwen3-Next, Qwen3.5, Gemma):
    the reference rounds as transformers does, the product in float32 cast once. The Triton path
    multiplies by a float32 copy of 1 + weight that `refresh` makes after loading. A weight k times
    the last dim normalises each of k groups of an input [..., k, D] with its part of the weight
    (hyper-connection streams; the PyTorch path only)."""

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__(hidden_size, eps, use_triton)
        self.weight.data.zero_()
        self.register_buffer("shifted", torch.ones(hidden_size, dtype=torch.float32), persistent=False)

    def refresh(self) -> None:
        self.shifted.copy_(1.0 + self.weight.detach().float())

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            from tokenmill.kernels.rms_norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.shifted, self.eps).to(x.dtype)
            out, total = fused_add_rms_norm(x, residual, self.shifted, self.eps)
            return out.to(x.dtype), total
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float()).view(-1, h.shape[-1]).squeeze(0)).to(x.dtype)


GATE_ACTIVATIONS = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * act(gate) over the last dim (the output norm of gated linear attention):
    act is SiLU, or sigmoid for Qwen4Exp's `output_gate_type`."""

    def __init__(self, hidden_size: int, eps: float, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ConfigError(f"the gated norm's activation {activation!r} is not one of {', '.join(GATE_ACTIVATIONS)}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.activation = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * self.activation(gate.float())).to(dtype)

"""Random packed batches for the gated-delta-rule and causal-conv1d tests: tokens of several
requests back to back, each owning a shuffled pool slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DeltaBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.g, self.beta, self.state, self.slots, self.cu_seqlens, self.has_initial_state)

    def rows(self, r: int) -> slice:
        return slice(int(self.cu_seqlens[r]), int(self.cu_seqlens[r + 1]))


def delta_batch(
    lengths: list[int], initial: list[bool], *, key_heads: int = 2, value_heads: int = 4, key_dim: int = 8,
    value_dim: int = 16, per_channel: bool = False, dtype: torch.dtype = torch.float32,
    state_dtype: torch.dtype = torch.float32, spare_slots: int = 3, seed: int = 0, device: str = "cpu",
    gate_scale: float = 1.0, correlated_keys: bool = False,
) -> DeltaBatch:
    """Log-decays as the models make them (-exp(A_log) softplus(a)), per head or per key channel.
    correlated_keys: every key near one direction per head, so beta k_i . k_j is near beta and
    the chunk's triangular system is far from the identity (the hard case for the UT transform)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    num_slots = len(lengths) + spare_slots

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    gate_shape = (total, value_heads, key_dim) if per_channel else (total, value_heads)
    g = -gate_scale * torch.rand(gate_shape[1:], generator=gen).add(0.2) * F.softplus(randn(*gate_shape))
    state = randn(num_slots, value_heads, key_dim, value_dim) * 0.5
    slots = torch.randperm(num_slots, generator=gen)[: len(lengths)]
    starts = torch.tensor([0] + lengths).cumsum(0)
    k = randn(total, key_heads, key_dim)
    if correlated_keys:
        k = randn(1, key_heads, key_dim) + 0.3 * k
    return DeltaBatch(
        q=randn(total, key_heads, key_dim).to(dtype).to(device),
        k=k.to(dtype).to(device),
        v=randn(total, value_heads, value_dim).to(dtype).to(device),
        g=g.float().to(device),
        beta=torch.rand(total, value_heads, generator=gen).to(dtype).to(device),
        state=state.to(state_dtype).to(device),
        slots=slots.to(torch.int32).to(device),
        cu_seqlens=starts.to(torch.int32).to(device),
        has_initial_state=torch.tensor(initial, dtype=torch.bool, device=device),
        scale=key_dim**-0.5,
    )


def checkpoint_slots(total: int, positions: dict[int, int], device: str = "cpu") -> torch.Tensor:
    """[T] int32: -1 everywhere but the given token -> slot entries."""
    out = torch.full((total,), -1, dtype=torch.int32)
    for token, slot in positions.items():
        out[token] = slot
    return out.to(device)


@dataclass
class ConvBatch:
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    conv_state: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor

    def args(self) -> tuple:
        return (self.x, self.weight, self.bias, self.conv_state, self.slots, self.cu_seqlens, self.has_initial_state)


def conv_batch(
    lengths: list[int], initial: list[bool], *, channels: int = 24, width: int = 4, bias: bool = True,
    dtype: torch.dtype = torch.float32, spare_slots: int = 3, seed: int = 0, device: str = "cpu",
) -> ConvBatch:
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(lengths) + spare_slots
    slots = torch.randperm(num_slots, generator=gen)[: len(lengths)]
    return ConvBatch(
        x=torch.randn(sum(lengths), channels, generator=gen).to(dtype).to(device),
        weight=torch.randn(channels, width, generator=gen).to(dtype).to(device),
        bias=torch.randn(channels, generator=gen).to(dtype).to(device) if bias else None,
        conv_state=torch.randn(num_slots, width - 1, channels, generator=gen).to(dtype).to(device),
        slots=slots.to(torch.int32).to(device),
        cu_seqlens=torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device),
        has_initial_state=torch.tensor(initial, dtype=torch.bool, device=device),
    )

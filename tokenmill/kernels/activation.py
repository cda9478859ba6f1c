"""SiLU-and-mul: out = silu(x[..., :I]) * x[..., I:], rounding as PyTorch does in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._common import dependent_launch, launch_next


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, LAUNCH_NEXT: tl.constexpr):
    launch_next(LAUNCH_NEXT)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
            x2, out, x2.stride(0), out.stride(0), n_cols, BLOCK=block, LAUNCH_NEXT=dependent_launch(x.device), num_warps=4
        )
    return out.view(*x.shape[:-1], n_cols)

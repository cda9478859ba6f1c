"""RMSNorm, alone or fused with the residual add that precedes it, rounding as Hugging Face's
Llama does: the sum in the model dtype, the norm in float32, the weight product in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import dependent_launch, launch_next, next_pow2


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LAUNCH_NEXT: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is loaded with x, not after the reduction: one memory round trip, not two.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, 0) / n_cols + eps)
    h = (h * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res2 = res_out = x2
    if residual is not None:
        res2 = residual.reshape(-1, n_cols)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x2)
    block = next_pow2(n_cols)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n_cols, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, LAUNCH_NEXT=dependent_launch(x.device),
            num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    return _launch(x, residual, weight, eps)

"""RMSNorm, alone or fused with the residual add that precedes it, rounding as Hugging Face's
Llama does: the sum in the model dtype, the norm in float32, the weight product in the model dtype.

The steered variant (layers/steering.py) first ablates a direction from the write with its
token's request strength, x - lam (x . r) r in float32 rounded to the model dtype (the write as it
was where lam == 0), and can record the projection of the sum on the direction per row.
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
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, dir_ptr, strength_ptr, rows_ptr, probe_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, LAUNCH_NEXT: tl.constexpr, STEER: tl.constexpr,
    PROBE: tl.constexpr,
):
    launch_next(LAUNCH_NEXT)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is loaded with x, not after the reduction: one memory round trip, not two.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if STEER:
        d = tl.load(dir_ptr + cols, mask=mask, other=0.0)
        lam = tl.load(strength_ptr + tl.load(rows_ptr + row)).to(tl.float32)
        xf = x.to(tl.float32)
        steered = (xf - (lam * tl.sum(xf * d, 0)) * d).to(dtype)
        x = tl.where(lam != 0.0, steered, x)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    elif STEER:  # the first layer: the ablated embedding is the stream
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    if PROBE:
        tl.store(probe_ptr + row, tl.sum(x.to(tl.float32) * d, 0))
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, 0) / n_cols + eps)
    h = (h * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            steer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, probe: torch.Tensor | None = None):
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
    elif steer is not None:
        res_out = torch.empty_like(x2)
    direction, strengths, rows = steer if steer is not None else (weight, weight, weight)
    block = next_pow2(n_cols)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, direction, strengths, rows, weight if probe is None else probe,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n_cols, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, LAUNCH_NEXT=dependent_launch(x.device),
            STEER=steer is not None, PROBE=probe is not None,
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


def steered_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, direction: torch.Tensor,
    strengths: torch.Tensor, token_rows: torch.Tensor, probe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = ablate(x) + residual (ablate(x) when residual is None); ablate(x) =
    x - lam (x . d) d per row, lam = strengths[token_rows[row]] (float32), d a float32 unit vector.
    `probe` ([rows] float32) receives s . d."""
    if probe is not None and not direction.shape[0] == x.shape[-1]:
        raise ValueError("the probe needs the direction of the rows' width")
    return _launch(x, residual, weight, eps, (direction, strengths, token_rows), probe)


def steered_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, direction: torch.Tensor,
    strengths: torch.Tensor, token_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, stream, stream . d): what steered_add_rms_norm computes, in torch ops."""
    c = strengths.float()[token_rows].unsqueeze(-1)
    xf = x.float()
    steered = torch.where(c != 0, (xf - c * (xf @ direction).unsqueeze(-1) * direction).to(x.dtype), x)
    stream = steered if residual is None else steered + residual
    return rms_norm_ref(stream, weight, eps), stream, stream.float() @ direction

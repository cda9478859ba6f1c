"""The steered add + RMSNorm kernel (layers/steering.py's CUDA path) against its reference: rows at
strength 0 equal the unsteered kernel's bit for bit, the others the reference within rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.rms_norm import (
    fused_add_rms_norm,
    rms_norm,
    steered_add_rms_norm,
    steered_add_rms_norm_ref,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("residual", [True, False], ids=["add", "first-layer"])
@pytest.mark.parametrize(
    "requests,hidden,dtype,device",
    [
        on_cpu(4, 64, torch.float32, id="tiny-f32"),
        on_cpu(3, 96, torch.bfloat16, id="tiny-odd-bf16"),
        on_gpu(64, 4096, torch.bfloat16, id="llama-decode-64"),
        on_gpu(1, 4096, torch.bfloat16, id="llama-decode-1"),
    ],
)
def test_steered_norm(requests, hidden, dtype, device, residual) -> None:
    torch.manual_seed(0)
    rows_per_request = 3
    tokens = requests * rows_per_request
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    res = torch.randn(tokens, hidden, device=device, dtype=dtype) if residual else None
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    direction = torch.randn(hidden, device=device, dtype=torch.float64)
    direction = (direction / direction.norm()).float()
    strengths = torch.tensor([0.0, 1.0, 0.5, 2.0] * requests, device=device)[:requests]
    token_rows = torch.arange(requests, device=device).repeat_interleave(rows_per_request)
    probe = torch.empty(tokens, device=device)

    normed, stream = steered_add_rms_norm(x, res, weight, 1e-5, direction, strengths, token_rows, probe)
    ref_normed, ref_stream, ref_probe = steered_add_rms_norm_ref(x, res, weight, 1e-5, direction, strengths, token_rows)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(stream, ref_stream, rtol=rtol, atol=atol)
    torch.testing.assert_close(normed, ref_normed, rtol=rtol, atol=atol)
    torch.testing.assert_close(probe, ref_probe, rtol=1e-3, atol=5e-2 if dtype == torch.bfloat16 else 1e-4)

    # Strength 0: the unsteered kernel's output, exactly.
    plain_normed, plain_stream = fused_add_rms_norm(x, res, weight, 1e-5) if residual else (rms_norm(x, weight, 1e-5), x)
    zero = (strengths[token_rows] == 0).nonzero().squeeze(-1)
    assert zero.numel() == rows_per_request * ((requests + 3) // 4)
    assert torch.equal(stream[zero], plain_stream[zero])
    assert torch.equal(normed[zero], plain_normed[zero])
    # Strength 1 removes the direction from the write: the stream's component is the residual's.
    full = (strengths[token_rows] == 1).nonzero().squeeze(-1)
    if full.numel() and dtype == torch.float32:
        before = res[full].float() @ direction if residual else torch.zeros(full.numel(), device=device)
        torch.testing.assert_close(stream[full].float() @ direction, before, rtol=0, atol=1e-4)

"""Checks the two few-row matmul kernels (gemv, few_row_mma) share: same signature, same contract."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.kernels.gemv import gemv_ref
from tokenmill.quantization import fp8_rows

FewRowMatmul = Callable[..., torch.Tensor]


def assert_every_row_matches_linear(
    kernel: FewRowMatmul, rows: int, n: int, k: int, fp8: bool, dtype: torch.dtype, device: str
) -> None:
    """Each row of x gets its own product with the one stream of W (bias included); FP8 rows
    are scaled by their scale; each row is checked against its own reference."""
    torch.manual_seed(4)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    weight = 0.05 * torch.randn(n, k, device=device)
    bias = torch.randn(n, device=device, dtype=dtype)
    weight, scale = fp8_rows(weight) if fp8 else (weight.to(dtype), None)
    expected = gemv_ref(x, weight, bias, scale)
    actual = kernel(x, weight, bias, weight_scale=scale)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    for row in range(rows):
        scale_of_row = expected[row].abs().max().item()
        tol = 1e-5 * max(1.0, scale_of_row) if dtype == torch.float32 else 2e-2 * scale_of_row
        torch.testing.assert_close(actual[row].float(), expected[row], rtol=0, atol=tol)


def assert_every_fp8_code_is_read_exactly(kernel: FewRowMatmul, rows: int, dtype: torch.dtype, device: str) -> None:
    """W holds each of the 254 finite E4M3 codes (subnormals, both zeros, 448); one-hot rows of x
    pick them out `rows` at a time: each product is the code's value times its row scale,
    exactly (rounded only to x's dtype on the way out)."""
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128).clone()
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN codes
    weight = codes.view(torch.float8_e4m3fn).to(device)
    scale = torch.tensor([0.5, 3.0], device=device)
    expected = weight.float() * scale[:, None]  # [2, 128]: what row n gives for x = e_j
    for first in range(0, 128, rows):
        x = torch.eye(128, device=device, dtype=dtype)[first : first + rows]
        actual = kernel(x, weight, weight_scale=scale).float()
        assert torch.equal(actual, expected[:, first : first + rows].T.to(dtype).float())


def assert_dependent_launch_reads_x_after_its_producer(kernel: FewRowMatmul, rows: int, n: int, k: int) -> None:
    """Launched as a programmatic dependent of the norm that writes x (which lets it start at
    once), the matmul equals a plain launch bit for bit, in a CUDA graph as on a stream."""
    from tokenmill.kernels.rms_norm import fused_add_rms_norm

    torch.manual_seed(3)
    residual = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16)

    def step(pdl: bool) -> torch.Tensor:
        outputs = []
        for i in range(8):  # each x differs and is written by the kernel just before the matmul
            x, _ = fused_add_rms_norm(residual * (i + 1), residual, norm, 1e-5)
            outputs.append(kernel(x, weight, pdl=pdl))
        return torch.cat(outputs)

    plain = step(False)
    assert torch.equal(step(True), plain)
    graph = torch.cuda.CUDAGraph()
    step(True)
    with torch.cuda.graph(graph):
        captured = step(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, plain)

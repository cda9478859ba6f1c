"""The tensor-core few-row matmul (bf16/fp16/fp32 or FP8 weights, 1..16 rows of x)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.few_row_mma import MMA_ROWS, few_row_mma
from tokenmill.kernels.gemv import GemvTile, gemv_ref
from tokenmill.layers.linear import fp8_rows


@pytest.mark.parametrize(
    "rows,n,k,fp8,dtype,device",
    [
        on_cpu(2, 21, 100, False, torch.float32, id="2-rows-ragged-f32"),
        on_cpu(5, 48, 64, False, torch.bfloat16, id="5-rows-bf16"),
        on_cpu(MMA_ROWS, 40, 96, True, torch.bfloat16, id="fp8-max-rows"),
        on_cpu(3, 33, 70, True, torch.float16, id="fp8-ragged-f16"),
        on_gpu(5, 6144, 4096, False, torch.bfloat16, id="llama-qkv-verify"),
        on_gpu(5, 4096, 4096, False, torch.bfloat16, id="llama-o-verify"),
        on_gpu(16, 28672, 4096, False, torch.bfloat16, id="llama-gate-up-16"),
        on_gpu(8, 4096, 14336, False, torch.bfloat16, id="llama-down-8"),
        on_gpu(2, 128256, 4096, False, torch.bfloat16, id="llama-head-2"),
        on_gpu(2, 2048, 8192, True, torch.bfloat16, id="1b-down-fp8-catch-up"),
        on_gpu(5, 32768, 2048, True, torch.bfloat16, id="draft-head-fp8"),
        on_gpu(7, 1000, 3000, False, torch.float32, id="ragged-f32"),
        on_gpu(3, 1000, 3000, True, torch.float16, id="ragged-fp8-f16"),
    ],
)
def test_every_row_matches_linear(rows: int, n: int, k: int, fp8: bool, dtype: torch.dtype, device: str) -> None:
    """Each row of x gets its own product (the zero rows padding x to the MMA are never stored);
    FP8 rows are scaled by their scale; float32 multiplies in float32, not TF32."""
    torch.manual_seed(4)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    weight = 0.05 * torch.randn(n, k, device=device)
    bias = torch.randn(n, device=device, dtype=dtype)
    weight, scale = fp8_rows(weight) if fp8 else (weight.to(dtype), None)
    expected = gemv_ref(x, weight, bias, scale)
    actual = few_row_mma(x, weight, bias, weight_scale=scale)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    for row in range(rows):
        scale_of_row = expected[row].abs().max().item()
        tol = 1e-5 * max(1.0, scale_of_row) if dtype == torch.float32 else 2e-2 * scale_of_row
        torch.testing.assert_close(actual[row].float(), expected[row], rtol=0, atol=tol)


@pytest.mark.parametrize("tile", [GemvTile(16, 16, 1, 1), GemvTile(32, 64, 2, 2)])
def test_tiles_agree(tile: GemvTile) -> None:
    torch.manual_seed(2)
    x, weight = torch.randn(4, 70), torch.randn(50, 70)
    torch.testing.assert_close(few_row_mma(x, weight, tile=tile), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_every_fp8_code_is_read_exactly(device: str) -> None:
    """W holds each of the 254 finite E4M3 codes; one-hot rows of x (bf16, as a model's) pick them
    out: each product is the code's value times its row scale, exactly (the widening is exact)."""
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128).clone()
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN codes
    weight = codes.view(torch.float8_e4m3fn).to(device)
    scale = torch.tensor([0.5, 3.0], device=device)
    expected = weight.float() * scale[:, None]
    for first in range(0, 128, MMA_ROWS):
        x = torch.eye(128, device=device, dtype=torch.bfloat16)[first : first + MMA_ROWS]
        actual = few_row_mma(x, weight, weight_scale=scale).float()
        assert torch.equal(actual, expected[:, first : first + MMA_ROWS].T.bfloat16().float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
def test_dependent_launch_reads_x_only_after_its_producer() -> None:
    """Launched as a programmatic dependent of the norm that writes x, bit for bit a plain launch."""
    from tokenmill.kernels.rms_norm import fused_add_rms_norm

    torch.manual_seed(3)
    residual = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(6144, 4096, device="cuda")).to(torch.bfloat16)
    norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16)

    def step(pdl: bool) -> torch.Tensor:
        outputs = []
        for i in range(8):
            x, _ = fused_add_rms_norm(residual * (i + 1), residual, norm, 1e-5)
            outputs.append(few_row_mma(x, weight, pdl=pdl))
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


def test_refuses_bad_shapes_dtypes_and_scales() -> None:
    with pytest.raises(ValueError, match=r"x \[M <= 16, K\]"):
        few_row_mma(torch.randn(MMA_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"x \[M <= 16, K\]"):
        few_row_mma(torch.randn(2, 6), torch.randn(4, 8))
    with pytest.raises(ValueError, match="must share a dtype"):
        few_row_mma(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.bfloat16))
    weight, scale = fp8_rows(torch.randn(4, 8))
    with pytest.raises(ValueError, match="FP8 weights need a float32 weight_scale"):
        few_row_mma(torch.randn(2, 8), weight)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[4\]"):
        few_row_mma(torch.randn(2, 8), weight, weight_scale=scale[:3])

"""The few-row FMA matmul kernel (bf16/fp16/fp32 or FP8 weights) and the Linear layer that dispatches
between it, the tensor-core kernel and torch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu
from matmul_checks import (
    assert_dependent_launch_reads_x_after_its_producer,
    assert_every_fp8_code_is_read_exactly,
    assert_every_row_matches_linear,
)

from tokenmill.kernels.few_row_mma import MMA_ROWS, few_row_mma, fp8_linear
from tokenmill.kernels.gemv import MAX_ROWS, GemvTile, gemv, gemv_ref
from tokenmill.layers.linear import Linear
from tokenmill.quantization import UnquantizedLinearMethod, fp8_rows, quantize_fp8_
from tokenmill.quantization.unquantized import FMA_ROWS


@pytest.mark.parametrize(
    "n,k,bias,dtype,device",
    [
        on_cpu(24, 64, False, torch.float32, id="tiny"),
        on_cpu(21, 100, True, torch.float32, id="ragged-bias"),  # N and K not multiples of the tile
        on_cpu(16, 96, False, torch.bfloat16, id="tiny-bf16"),
        on_gpu(6144, 4096, False, torch.bfloat16, id="llama-qkv"),
        on_gpu(4096, 14336, False, torch.bfloat16, id="llama-down"),
        on_gpu(128256, 4096, False, torch.bfloat16, id="llama-head"),
        on_gpu(16384, 2048, False, torch.bfloat16, id="1b-gate-up"),
        on_gpu(3584, 3584, True, torch.bfloat16, id="qwen-qkv-bias"),
        on_gpu(2048, 2000, False, torch.float16, id="ragged-f16"),
        on_gpu(1000, 3000, True, torch.float32, id="ragged-f32"),
    ],
)
def test_gemv_matches_linear(n, k, bias, dtype, device) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, k, device=device, dtype=dtype)
    weight = (0.05 * torch.randn(n, k, device=device)).to(dtype)
    b = torch.randn(n, device=device, dtype=dtype) if bias else None
    expected = gemv_ref(x.float(), weight.float(), None if b is None else b.float())
    actual = gemv(x, weight, b)
    assert actual.shape == (1, n) and actual.dtype == dtype
    scale = expected.abs().max().item()
    tol = 1e-5 * max(1.0, scale) if dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(actual.float(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("tile", [GemvTile(4, 32, 1, 1), GemvTile(8, 16, 2, 2)])
def test_gemv_tiles_agree(tile: GemvTile) -> None:
    torch.manual_seed(2)
    x, weight = torch.randn(1, 70), torch.randn(30, 70)
    torch.testing.assert_close(gemv(x, weight, tile=tile), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows,n,k,fp8,dtype,device",
    [
        on_cpu(2, 21, 100, False, torch.float32, id="2-rows"),
        on_cpu(5, 24, 64, False, torch.bfloat16, id="5-rows-bf16"),
        on_cpu(MAX_ROWS, 21, 100, False, torch.float32, id="max-rows"),
        on_cpu(1, 21, 100, True, torch.float32, id="fp8"),
        on_cpu(3, 24, 64, True, torch.bfloat16, id="fp8-3-rows"),
        on_cpu(MAX_ROWS, 21, 100, True, torch.float32, id="fp8-max-rows"),
        on_gpu(5, 6144, 4096, False, torch.bfloat16, id="llama-qkv-verify"),
        on_gpu(5, 128256, 4096, False, torch.bfloat16, id="llama-head-verify"),
        on_gpu(8, 4096, 14336, False, torch.bfloat16, id="llama-down-8"),
        on_gpu(1, 16384, 2048, True, torch.bfloat16, id="1b-gate-up-fp8"),
        on_gpu(1, 2048, 8192, True, torch.bfloat16, id="1b-down-fp8"),
        on_gpu(2, 2048, 8192, True, torch.bfloat16, id="1b-down-fp8-catch-up"),
        on_gpu(5, 32768, 2048, True, torch.bfloat16, id="draft-head-fp8"),
        on_gpu(3, 1000, 3000, True, torch.float16, id="ragged-fp8-f16"),
    ],
)
def test_every_row_matches_linear(rows: int, n: int, k: int, fp8: bool, dtype: torch.dtype, device: str) -> None:
    assert_every_row_matches_linear(gemv, rows, n, k, fp8, dtype, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 2048), (4096, 14336), (1000, 3000)])
def test_dependent_launch_reads_x_only_after_its_producer(n: int, k: int) -> None:
    assert_dependent_launch_reads_x_after_its_producer(gemv, 1, n, k)


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_every_fp8_code_is_read_exactly(device: str) -> None:
    assert_every_fp8_code_is_read_exactly(gemv, MAX_ROWS, torch.float32, device)


def test_gemv_refuses_bad_shapes_and_scales() -> None:
    with pytest.raises(ValueError, match=r"x \[M <= 8, K\]"):
        gemv(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="x \\[M <= 8, K\\]"):
        gemv(torch.randn(2, 6), torch.randn(4, 8))
    weight, scale = fp8_rows(torch.randn(4, 8))
    with pytest.raises(ValueError, match="FP8 weights need a float32 weight_scale"):
        gemv(torch.randn(1, 8), weight)
    with pytest.raises(ValueError, match="only FP8 weights take one"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), weight_scale=scale)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[4\]"):
        gemv(torch.randn(1, 8), weight, weight_scale=scale[:3])


@pytest.mark.parametrize("rows", [1, 2, 5, MMA_ROWS, MMA_ROWS + 1, 3 * MMA_ROWS + 5])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("in_features", [40, 60], ids=["short-rows", "long-rows"])
def test_linear_dispatch_gives_torch_result(
    rows: int, fp8: bool, in_features: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to FMA_ROWS rows (FP8 weights: MAX_ROWS) go through the FMA kernel; unquantized weights
    up to MMA_ROWS through the tensor-core one where it suits the shape (not rows more than twice
    as long as there are rows), more through torch; FP8 weights past MAX_ROWS through the
    tensor-core kernel, any number of rows (float32 x: never W8A8): all equal F.linear on the
    real weight."""
    import tokenmill.kernels.few_row_mma as mma_module
    import tokenmill.kernels.fp8_gemm as fp8_module
    import tokenmill.kernels.gemv as fma_module

    calls = []
    for module in (fma_module, fp8_module):  # FP8 layers dispatch through fp8_gemm.scaled_fp8_linear
        monkeypatch.setattr(module, "gemv", lambda *args, **kwargs: calls.append("fma") or gemv(*args, **kwargs))
    for module in (mma_module, fp8_module):
        monkeypatch.setattr(module, "few_row_mma",
                            lambda *args, **kwargs: calls.append("mma") or few_row_mma(*args, **kwargs))
        monkeypatch.setattr(module, "fp8_linear",
                            lambda *args, **kwargs: calls.append("mma") or fp8_linear(*args, **kwargs))
    torch.manual_seed(1)
    layer = Linear(in_features, 24, bias=True, method=UnquantizedLinearMethod(use_triton=True))
    if fp8:
        quantize_fp8_(layer)
    x = torch.randn(rows, in_features)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    mma_ok = fp8 or in_features <= 2 * 24
    if rows <= (MAX_ROWS if fp8 else FMA_ROWS):
        assert calls == ["fma"]
    else:
        assert calls == (["mma"] if fp8 or rows <= MMA_ROWS and mma_ok else [])

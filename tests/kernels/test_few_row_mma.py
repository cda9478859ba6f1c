"""The tensor-core few-row matmul (bf16/fp16/fp32 or FP8 weights, 1..16 rows of x), and fp8_linear (FP8 weights, any rows)."""

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
from tokenmill.kernels.gemv import GemvTile
from tokenmill.quantization import fp8_rows


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
    """The zero rows padding x to the MMA are never stored; float32 multiplies in float32, not TF32."""
    assert_every_row_matches_linear(few_row_mma, rows, n, k, fp8, dtype, device)


@pytest.mark.parametrize("tile", [GemvTile(16, 16, 1, 1), GemvTile(32, 64, 2, 2)])
def test_tiles_agree(tile: GemvTile) -> None:
    torch.manual_seed(2)
    x, weight = torch.randn(4, 70), torch.randn(50, 70)
    torch.testing.assert_close(few_row_mma(x, weight, tile=tile), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_every_fp8_code_is_read_exactly(device: str) -> None:
    """x in bf16, as a model's: the widening of FP8 to bf16 before the MMA is exact."""
    assert_every_fp8_code_is_read_exactly(few_row_mma, MMA_ROWS, torch.bfloat16, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
def test_dependent_launch_reads_x_only_after_its_producer() -> None:
    assert_dependent_launch_reads_x_after_its_producer(few_row_mma, 5, 6144, 4096)


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


@pytest.mark.parametrize(
    "rows,n,k,dtype,device",
    [
        on_cpu(MMA_ROWS + 1, 21, 70, torch.bfloat16, id="one-row-past-a-tile"),
        on_cpu(3 * MMA_ROWS + 5, 40, 96, torch.float16, id="four-row-tiles-ragged"),
        on_cpu(2, 33, 64, torch.float32, id="few-rows-f32"),
        on_gpu(128, 16384, 2048, torch.bfloat16, id="1b-gate-up-prompt"),
        on_gpu(300, 2048, 8192, torch.bfloat16, id="1b-down-ragged-rows"),
        on_gpu(65, 32768, 2048, torch.bfloat16, id="draft-head-one-past-a-tile"),
        on_gpu(9, 3072, 2048, torch.bfloat16, id="1b-qkv-few-rows"),
    ],
)
def test_fp8_linear_matches_linear_for_any_rows(rows: int, n: int, k: int, dtype: torch.dtype, device: str) -> None:
    """Every row of every row tile (the last one ragged) gets its own product; rows past M are never stored."""
    assert_every_row_matches_linear(fp8_linear, rows, n, k, True, dtype, device)


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_fp8_linear_reads_every_fp8_code_exactly_across_row_tiles(device: str) -> None:
    assert_every_fp8_code_is_read_exactly(fp8_linear, 3 * MMA_ROWS + 1, torch.bfloat16, device)


def test_fp8_linear_refuses_unquantized_weights_and_empty_x() -> None:
    weight, scale = fp8_rows(torch.randn(4, 8))
    with pytest.raises(ValueError, match="takes an FP8 E4M3 weight"):
        fp8_linear(torch.randn(2, 8), weight.float(), weight_scale=scale)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        fp8_linear(torch.randn(0, 8), weight, weight_scale=scale)

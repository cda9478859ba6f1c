"""The few-row W8A8 kernel (x quantized to E4M3 in the kernel, FP8 tensor cores) against the W8A8
reference by torch (x quantized per token or per token per 128 columns, both operands dequantized,
float32 matmul): one row and several, per-row and block scales, split K with even and ragged
splits, bias, all-zero rows (scale 1.0)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels import w8a8_few_row as module
from tokenmill.kernels.fp8_gemm import quantize_activations_ref, w8a8_ref
from tokenmill.kernels.gemv import GemvTile
from tokenmill.kernels.w8a8_few_row import w8a8_few_row, w8a8_splits
from tokenmill.numerics import FP8_E4M3, scale_grid_shape

LAYOUTS = {"rows": (1, 0), "block-128": (128, 128), "block-rows": (1, 128)}


def operands(n: int, k: int, rows: int, block: tuple[int, int], dtype: torch.dtype, device: str):
    weight = (torch.randn(n, k, device=device) * 60).clamp(-448, 448).to(FP8_E4M3)
    grid = scale_grid_shape(n, k, block)
    scale = torch.rand(grid, device=device) * 0.01 + 1e-4
    # Rows of very different magnitudes (and outliers), so that per-token scales matter.
    x = torch.randn(rows, k, device=device) * torch.logspace(-2, 2, rows, device=device)[:, None]
    x[:, 3] *= 40
    if rows > 2:
        x[1] = 0
    return x.to(dtype), weight, scale.view(-1) if block[1] == 0 else scale


def call(x, weight, scale, block, bias=None, **options):
    return w8a8_few_row(x, weight, scale, None if block[1] == 0 else block[0], bias, **options)


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 8e-3) -> None:
    for row in range(actual.shape[0]):
        top = max(expected[row].abs().max().item(), 1e-30)
        torch.testing.assert_close(actual[row].float(), expected[row].float(), rtol=0, atol=tolerance * top)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize(
    "rows,n,k,tile,splits,dtype,device",
    [
        on_cpu(1, 40, 256, GemvTile(16, 128, 1, 1), 1, torch.bfloat16, id="one-row"),
        on_cpu(3, 40, 256, GemvTile(16, 128, 1, 1), 1, torch.float16, id="rows-fp16"),
        on_cpu(16, 24, 384, GemvTile(16, 128, 1, 1), 3, torch.bfloat16, id="sixteen-rows-even-splits"),
        on_cpu(1, 24, 640, GemvTile(16, 128, 1, 1), 2, torch.bfloat16, id="one-row-ragged-splits"),
        on_gpu(1, 6144, 4096, None, None, torch.bfloat16, id="qkv-decode"),
        on_gpu(4, 4096, 14336, None, None, torch.bfloat16, id="down-verify"),
        on_gpu(16, 28672, 4096, None, None, torch.bfloat16, id="gate-up-block"),
        on_gpu(3, 4096, 4096, GemvTile(64, 128, 4, 4), 5, torch.float16, id="o-ragged-splits"),
    ],
)
def test_matches_the_w8a8_reference(layout, rows, n, k, tile, splits, dtype, device) -> None:
    block = LAYOUTS[layout]
    torch.manual_seed(rows * 7 + k)
    x, weight, scale = operands(n, k, rows, block, dtype, device)
    bias = torch.randn(n, device=device).to(dtype)
    actual = call(x, weight, scale, block, bias, tile=tile, splits=splits)
    expected = w8a8_ref(x, weight, scale, block, bias)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    assert_rows_close(actual, expected)
    counters = module._COUNTERS.get(torch.device(device))
    assert counters is None or not counters.any()  # every split-K launch leaves its counters zeroed


@pytest.mark.parametrize("rows", [1, 5])
def test_per_row_scales_take_a_k_of_no_whole_strips(rows: int) -> None:
    """K = 520 (strips of 128 and 2 splits leave a ragged tail): per-row scales have no column
    groups, so any K is taken; the tail's columns are masked."""
    torch.manual_seed(rows)
    x, weight, scale = operands(24, 520, rows, (1, 0), torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu")
    actual = call(x, weight, scale, (1, 0), tile=GemvTile(16, 128, 1, 1), splits=2)
    assert_rows_close(actual, w8a8_ref(x, weight, scale, (1, 0)))


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("rows", [1, 3])
def test_x_is_quantized_as_the_prefill_quantizes_it(layout: str, rows: int) -> None:
    """An identity weight returns x as the kernel quantized it: each row (block layouts: each
    128 columns of it) on the E4M3 grid of its own scale, equal to the prefill's quantizer."""
    block = LAYOUTS[layout]
    k = 256
    x = (torch.randn(rows, k) * torch.tensor([0.01, 3.0, 200.0])[:rows, None]).to(torch.float16)
    weight = torch.eye(k).to(FP8_E4M3)
    scale = torch.ones(scale_grid_shape(k, k, block))
    scale = scale.view(-1) if block[1] == 0 else scale
    device = "cuda" if torch.cuda.is_available() else "cpu"
    actual = call(x.to(device), weight.to(device), scale.to(device), block).cpu()
    group = k if block[1] == 0 else 128
    q, s = quantize_activations_ref(x, group)
    expected = (q.float().view(rows, -1, group) * s[:, :, None]).view(rows, k)
    assert torch.equal(actual, expected.to(torch.float16))


def test_split_count_divides_the_strips_and_fills_the_machine() -> None:
    tile = GemvTile(128, 256, 4, 4)
    assert w8a8_splits(28672, 4096, tile, 132) == 1  # 224 tiles: one a multiprocessor already
    assert w8a8_splits(4096, 14336, tile, 132) == 4  # 32 tiles want 5 splits; 4 divide the 56 strips
    assert w8a8_splits(4096, 4096, tile, 132) == 4  # 16 strips: at least 4 a split
    assert w8a8_splits(6144, 4096, tile, 132) == 2  # 48 tiles want 3; 2 divide the 16 strips
    assert w8a8_splits(4096, 4096 + 64, tile, 132) == 4  # ragged K: the wanted count


def test_bad_operands_are_refused() -> None:
    weight = torch.zeros(32, 128).to(FP8_E4M3)
    scale = torch.ones(32)
    with pytest.raises(ValueError, match="16-bit x"):
        w8a8_few_row(torch.zeros(1, 128), weight, scale)
    with pytest.raises(ValueError, match="M <= 16"):
        w8a8_few_row(torch.zeros(17, 128, dtype=torch.bfloat16), weight, scale)
    with pytest.raises(ValueError, match="float32"):
        w8a8_few_row(torch.zeros(1, 128, dtype=torch.bfloat16), weight, torch.ones(2, 1), 128)

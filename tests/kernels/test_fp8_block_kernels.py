"""The weight-streaming kernels with block scales (128 x 128 FP8 blocks, per-row-expanded blocks,
MX groups of 32 with E8M0 codes), the activation quantizer and the W8A8 block-scaled GEMM, each
against its dequantize-then-matmul reference (interpreter on the CPU, tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.few_row_mma import few_row_mma, fp8_linear
from tokenmill.kernels.fp8_gemm import (
    quantize_activations,
    quantize_activations_ref,
    scaled_fp8_linear,
    w8a8_block_linear,
    w8a8_ref,
)
from tokenmill.kernels.gemv import GemvTile, gemv, gemv_ref
from tokenmill.numerics import FP8_E4M3, e8m0_exponent, scale_grid_shape

BLOCKS = {"block-128": (128, 128), "block-rows": (1, 128), "mx": (1, 32)}


def scaled_weight(n: int, k: int, block: tuple[int, int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random E4M3 weight and scales of every magnitude (E8M0 codes for MX groups)."""
    weight = (torch.randn(n, k, device=device) * 60).clamp(-448, 448).to(FP8_E4M3)
    grid = scale_grid_shape(n, k, block)
    if block[1] == 32:
        return weight, e8m0_exponent(torch.rand(grid, device=device) * 8 * 448)
    return weight, torch.rand(grid, device=device) * 0.01 + 1e-4


def assert_close_rows(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    for row in range(actual.shape[0]):
        top = expected[row].abs().max().item()
        tol = 1e-5 * max(1.0, top) if dtype == torch.float32 else 2e-2 * top
        torch.testing.assert_close(actual[row].float(), expected[row], rtol=0, atol=tol)


@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
@pytest.mark.parametrize(
    "kernel,rows,tile,dtype,device",
    [
        on_cpu("gemv", 3, GemvTile(4, 32, 1, 1), torch.float32, id="gemv-strip-in-group"),
        on_cpu("gemv", 1, GemvTile(4, 64, 1, 1), torch.bfloat16, id="gemv-groups-in-strip"),
        on_cpu("mma", 5, GemvTile(16, 32, 1, 1), torch.bfloat16, id="mma-strip-in-group"),
        on_cpu("mma", 16, GemvTile(16, 64, 1, 1), torch.float32, id="mma-groups-in-strip"),
        on_cpu("fp8_linear", 20, GemvTile(16, 64, 1, 1), torch.bfloat16, id="fp8-linear-rows"),
        on_gpu("gemv", 1, None, torch.bfloat16, id="gemv-default-tile"),
        on_gpu("mma", 9, None, torch.bfloat16, id="mma-default-tile"),
        on_gpu("fp8_linear", 300, None, torch.bfloat16, id="fp8-linear-default-tile"),
    ],
)
def test_block_scaled_weights_match_dequantize_then_matmul(kernel, rows, tile, dtype, device, block) -> None:
    torch.manual_seed(0)
    n, k = (72, 256) if device == "cpu" else (4096, 4096)
    weight, scale = scaled_weight(n, k, block, device)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    bias = torch.randn(n, device=device, dtype=dtype)
    expected = gemv_ref(x, weight, bias, scale, block)
    if kernel == "gemv":
        actual = gemv(x, weight, bias, tile=tile, weight_scale=scale, scale_block=block)
    elif kernel == "mma":
        actual = few_row_mma(x, weight, bias, tile=tile, weight_scale=scale, scale_block=block)
    else:
        actual = fp8_linear(x, weight, bias, weight_scale=scale, scale_block=block, tile=tile)
    assert actual.shape == (rows, n) and actual.dtype == dtype
    assert_close_rows(actual, expected, dtype)


def test_mx_scales_read_every_e8m0_code_exactly() -> None:
    """One-hot x picks out weight columns: each product is the E4M3 value times 2^(code - 127), exactly."""
    codes = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8) * 8 + 3  # codes 3..251 across the groups
    weight = torch.full((4, 256), 1.5).to(FP8_E4M3)
    x = torch.eye(256)[::32][:8]
    actual = gemv(x, weight, weight_scale=codes, scale_block=(1, 32))
    expected = (1.5 * torch.ldexp(torch.ones(4, 8), codes.int() - 127)).T
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("group", [128, 320], ids=["per-128", "per-token"])
@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_activation_quantization_matches_torch_exactly(group: int, device: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 320, device=device) * torch.logspace(-3, 3, 6, device=device)[:, None]
    x[2] = 0  # an all-zero row keeps scale 1
    q, s = quantize_activations(x.to(torch.bfloat16), group)
    q_ref, s_ref = quantize_activations_ref(x.to(torch.bfloat16), group)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("block", [(128, 128), (1, 128)], ids=["blocks", "rows-expanded"])
@pytest.mark.parametrize("rows,n,k,device", [on_cpu(33, 72, 384, id="tiny"), on_gpu(2048, 4096, 4096, id="llama-o")])
def test_w8a8_block_gemm_matches_its_reference(rows: int, n: int, k: int, device: str, block) -> None:
    torch.manual_seed(2)
    weight, scale = scaled_weight(n, k, block, device)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    expected = w8a8_ref(x, weight, scale, block, bias)
    actual = w8a8_block_linear(x, weight, scale, block[0], bias)
    assert_close_rows(actual, expected, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 12, 20])
@pytest.mark.parametrize("prefill,block", [("w8a8-rows", (1, 0)), ("w8a8-blocks", (128, 128)), ("w8a16", (1, 32))])
def test_scaled_fp8_linear_takes_every_path(rows: int, prefill: str, block) -> None:
    """One row streams the weight (weight-only); 2-16 rows of the W8A8 layouts go through the
    few-row W8A8 kernel (x per token, or per 128 columns for blocks), MX's through the weight-only
    few-row kernel; more rows go W8A8 with 128-column activation groups for block FP8 (the
    interpreter has no _scaled_mm: per-row FP8 past 16 rows and MX stay weight-only)."""
    torch.manual_seed(3)
    weight, scale = scaled_weight(48, 256, block, "cpu")
    if block == (1, 0):
        scale = scale.view(-1, 1)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    actual = scaled_fp8_linear(x, weight, scale, block, None, prefill)
    if (rows > 16 and prefill == "w8a8-blocks") or (1 < rows <= 16 and prefill != "w8a16"):
        expected = w8a8_ref(x, weight, scale, block)
    else:
        expected = gemv_ref(x, weight, None, scale.view(-1) if block == (1, 0) else scale,
                            None if block == (1, 0) else block)
    assert_close_rows(actual, expected, torch.bfloat16)

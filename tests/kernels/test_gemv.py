"""The one-row matmul kernel and the Linear layer that dispatches to it."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.gemv import GemvTile, gemv, gemv_ref
from tokenmill.layers.linear import Linear


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
@pytest.mark.parametrize("n,k", [(4096, 4096), (2048, 2048), (4096, 14336), (1000, 3000)])
def test_dependent_launch_reads_x_only_after_its_producer(n: int, k: int) -> None:
    """Launched as a programmatic dependent of the norm that writes x (which lets it start at
    once), the matmul equals a plain launch bit for bit, in a CUDA graph as on a stream."""
    from tokenmill.kernels.rms_norm import fused_add_rms_norm

    torch.manual_seed(3)
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16)

    def step(pdl: bool) -> torch.Tensor:
        outputs = []
        for i in range(8):  # each x differs and is written by the kernel just before the matmul
            x, _ = fused_add_rms_norm(residual * (i + 1), residual, norm, 1e-5)
            outputs.append(gemv(x, weight, pdl=pdl))
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


def test_gemv_refuses_more_than_one_row() -> None:
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_dispatch_gives_torch_result(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row goes through the kernel, several through torch: both equal F.linear."""
    import tokenmill.kernels.gemv as kernel

    calls = []
    monkeypatch.setattr(kernel, "gemv", lambda *args: calls.append(1) or gemv(*args))
    torch.manual_seed(1)
    layer = Linear(40, 24, bias=True, one_row_kernel=True)
    x = torch.randn(rows, 40)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert len(calls) == (rows == 1)

"""The MoE kernels with FP8 expert weights and their scales (one per row, 128 x 128 blocks, MX
groups of 32 with E8M0 codes): the few-row path (decode) and the grouped GEMMs (prefill) against
the reference on the dequantized experts; tiny shapes under the interpreter, Qwen3-30B-A3B's on CUDA."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.moe.experts import ExpertScales, fused_experts
from tokenmill.layers.moe import RoutingConfig, fused_experts_ref, select_experts_ref
from tokenmill.numerics import FP8_E4M3, dequantize_blocks, e8m0_exponent, scale_grid_shape

SCALES = {"rows": (1, 0), "block128": (128, 128), "rows-of-blocks": (1, 128), "mx": (1, 32)}
TINY = dict(experts=4, top_k=2, hidden=256, inter=64)
QWEN3_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)


def fp8_stack(experts: int, rows: int, cols: int, block: tuple[int, int], gen: torch.Generator):
    weight = (torch.randn(experts, rows, cols, generator=gen) * 50).clamp(-448, 448).to(FP8_E4M3)
    grid = (experts, *scale_grid_shape(rows, cols, block))
    if block[1] == 32:
        scale = e8m0_exponent(torch.rand(grid, generator=gen) * 448 * 2**-8 / cols**0.5)
    else:
        scale = (torch.rand(grid, generator=gen) + 0.5) / (50 * cols**0.5)
    return weight, scale


@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("shape,tokens,device", [on_cpu(TINY, 3, id="tiny-few-row"), on_cpu(TINY, 17, id="tiny-grouped"),
                                                 on_gpu(QWEN3_30B, 1, id="qwen3-30b-T1"),
                                                 on_gpu(QWEN3_30B, 2048, id="qwen3-30b-T2048")])
def test_fp8_experts_match_the_dequantized_reference(scales: str, shape: dict, tokens: int, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    experts, top_k, hidden, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    block = SCALES[scales]
    w13, s13 = fp8_stack(experts, 2 * inter, hidden, block, gen)
    w2, s2 = fp8_stack(experts, hidden, inter, block, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts_ref(torch.randn(tokens, experts, generator=gen), RoutingConfig(experts, top_k,
                                                                                                  renormalize=True))
    moved = [t.to(device) for t in (x, w13, w2, weights, ids, s13, s2)]
    x, w13, w2, weights, ids, s13, s2 = moved
    out = fused_experts(x, w13, w2, weights, ids, scales=ExpertScales(s13, s2, block, block))
    d13, d2 = dequantize_blocks(w13, s13, block), dequantize_blocks(w2, s2, block)
    expected = fused_experts_ref(x.float(), d13, d2, weights, ids)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=3e-2 * expected.abs().max().item())


def test_fp8_experts_need_their_scales() -> None:
    gen = torch.Generator().manual_seed(1)
    w13, s13 = fp8_stack(2, 64, 64, (1, 32), gen)
    w2, s2 = fp8_stack(2, 64, 32, (1, 32), gen)
    x, weights, ids = torch.randn(1, 64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="FP8 expert weights need their scales"):
        fused_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"scale groups of 48 columns and strips of 32 do not nest"):
        fused_experts(x, w13, w2, weights, ids, scales=ExpertScales(s13, s2, (1, 48), (1, 32)))

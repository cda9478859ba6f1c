"""The NVFP4 kernels against their dequantize-then-matmul references: the dense W4A16 kernel (few
rows and many, fused shards with their own global scales, K tails), the activation quantizer of
W4A4 bit for bit, the W4A4 product, and the MoE experts with NVFP4 weights on both paths (tiny
shapes under the interpreter; Llama-3.1-8B's and Qwen3-30B-A3B's on CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.gemv import GemvTile
from tokenmill.kernels.moe.experts import ExpertScales, fused_experts
from tokenmill.kernels.nvfp4 import (
    nvfp4_linear,
    nvfp4_linear_ref,
    nvfp4_w4a4_linear,
    quantize_nvfp4_activations,
    quantize_nvfp4_activations_ref,
)
from tokenmill.layers.moe import RoutingConfig, fused_experts_ref, select_experts_ref
from tokenmill.numerics import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4

TINY = dict(experts=4, top_k=2, hidden=96, inter=48)
QWEN3_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)


def nvfp4_weight(sizes: list[int], k: int, device: str, gen: torch.Generator | None = None):
    """(packed, scales, row scales) of shards of very different ranges, each with its own global scale."""
    parts = [torch.randn(rows, k, generator=gen) * 4.0 ** i for i, rows in enumerate(sizes)]
    rows = torch.cat([nvfp4_global_scale(p.abs().amax()).expand(p.shape[0]) for p in parts])
    packed, scale = quantize_nvfp4(torch.cat(parts), rows[:, None])
    return packed.to(device), scale.to(device), rows.to(device)


def assert_close_rows(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    for row in range(actual.shape[0]):
        top = expected[row].abs().max().item()
        tol = 2e-5 * max(1.0, top) if dtype == torch.float32 else 2e-2 * top
        torch.testing.assert_close(actual[row].float(), expected[row], rtol=0, atol=tol)


@pytest.mark.parametrize(
    "sizes,k,rows,tile,dtype,device",
    [
        on_cpu([32, 16, 16], 176, 1, None, torch.float32, id="qkv-K-tail-decode"),
        on_cpu([48], 128, 5, None, torch.bfloat16, id="bf16-few-rows"),
        on_cpu([40], 64, 20, (GemvTile(16, 64, 1, 1), 16), torch.float16, id="fp16-row-tiles"),
        on_cpu([24, 24], 96, 3, (GemvTile(16, 32, 1, 1), 16), torch.float32, id="gate-up-N-tail"),
        on_gpu([4096, 1024, 1024], 4096, 1, None, torch.bfloat16, id="llama-qkv-decode"),
        on_gpu([14336, 14336], 4096, 4, None, torch.bfloat16, id="llama-gate-up-verify"),
        on_gpu([4096], 14336, 2048, None, torch.bfloat16, id="llama-down-prefill"),
    ],
)
def test_nvfp4_linear_matches_dequantize_then_matmul(sizes, k, rows, tile, dtype, device) -> None:
    gen = torch.Generator().manual_seed(0)
    packed, scale, row_scale = nvfp4_weight(sizes, k, device, gen)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    bias = torch.randn(sum(sizes), generator=gen).to(device, dtype)
    actual = nvfp4_linear(x, packed, scale, row_scale, bias, tile=tile)
    assert actual.shape == (rows, sum(sizes)) and actual.dtype == dtype
    assert_close_rows(actual, nvfp4_linear_ref(x, packed, scale, row_scale, bias), dtype)


def test_every_e2m1_code_and_e4m3_scale_is_read_exactly() -> None:
    """W holds each of the 16 codes against scales from 2^-9 to 448; one-hot x picks the weights out
    one column at a time: each product is code * scale * row scale exactly."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 2)  # [4, 32]: every code twice a row
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.tensor([[2.0**-9, 448.0], [1.0, 0.3125], [6.0, 2.0**-6], [0.0078125, 240.0]]).to(torch.float8_e4m3fn)
    row_scale = torch.tensor([1.0, 0.5, 3.0, 2.0**-4])
    expected = dequantize_nvfp4(packed, scale, row_scale[:, None])  # [4, 32]
    for first in range(0, 32, 16):
        x = torch.eye(32)[first: first + 16]
        assert torch.equal(nvfp4_linear(x, packed, scale, row_scale), expected[:, first: first + 16].T)


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_activation_quantization_matches_numerics_bit_for_bit(device: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 160) * torch.logspace(-3, 2, 6)[:, None]
    x[2] = 0
    x[3, 5] = -0.0
    x = x.to(device, torch.bfloat16)
    input_scale = nvfp4_global_scale(x.float().abs().amax() / 2).to(device)  # some groups saturate
    q, s = quantize_nvfp4_activations(x, input_scale)
    q_ref, s_ref = quantize_nvfp4_activations_ref(x, input_scale)
    assert torch.equal(q, q_ref) and torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))


@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_w4a4_product_is_the_product_of_both_quantized_operands(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    packed, scale, row_scale = nvfp4_weight([64], 128, device, gen)
    x = torch.randn(9, 128, generator=gen).to(device, torch.bfloat16)
    input_scale = nvfp4_global_scale(x.float().abs().amax()).to(device)
    q, s = quantize_nvfp4_activations_ref(x, input_scale)
    expected = dequantize_nvfp4(q, s, input_scale) @ dequantize_nvfp4(packed, scale, row_scale[:, None]).T
    assert_close_rows(nvfp4_w4a4_linear(x, input_scale, packed, scale, row_scale), expected, torch.bfloat16)


def nvfp4_stack(experts: int, rows: int, cols: int, gen: torch.Generator, distinct_halves: bool):
    """Stacked experts, each [rows, cols]; gate and up (the two halves of w13) with their own global scales."""
    weight = torch.randn(experts, rows, cols, generator=gen) / cols**0.5
    if distinct_halves:
        weight[:, rows // 2:] *= 8
    halves = weight.unflatten(1, (2, -1)) if distinct_halves else weight[:, None]
    rows_scale = nvfp4_global_scale(halves.abs().amax(dim=(2, 3)))[:, :, None].expand(-1, -1, halves.shape[2])
    rows_scale = rows_scale.reshape(experts, rows).contiguous()
    packed, scale = quantize_nvfp4(weight, rows_scale[..., None])
    return packed, scale, rows_scale


@pytest.mark.parametrize("shape,tokens,device", [on_cpu(TINY, 3, id="tiny-few-row"), on_cpu(TINY, 17, id="tiny-grouped"),
                                                 on_gpu(QWEN3_30B, 1, id="qwen3-30b-T1"),
                                                 on_gpu(QWEN3_30B, 2048, id="qwen3-30b-T2048")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nvfp4_experts_match_the_dequantized_reference(shape: dict, tokens: int, device: str, dtype: torch.dtype) -> None:
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 experts at real shapes: the bf16 case covers the kernels")
    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    w13, s13, r13 = nvfp4_stack(experts, 2 * inter, hidden, gen, distinct_halves=True)
    w2, s2, r2 = nvfp4_stack(experts, hidden, inter, gen, distinct_halves=False)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = select_experts_ref(torch.randn(tokens, experts, generator=gen), RoutingConfig(experts, top_k,
                                                                                                  renormalize=True))
    x, w13, s13, r13, w2, s2, r2, weights, ids = (t.to(device) for t in (x, w13, s13, r13, w2, s2, r2, weights, ids))
    out = fused_experts(x, w13, w2, weights, ids, scales=ExpertScales(s13, s2, (1, 16), (1, 16), r13, r2))
    d13, d2 = dequantize_nvfp4(w13, s13, r13[..., None]), dequantize_nvfp4(w2, s2, r2[..., None])
    expected = fused_experts_ref(x.float(), d13, d2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=tol * expected.abs().max().item())


def test_refusals() -> None:
    packed, scale, rows = nvfp4_weight([16], 64, "cpu")
    with pytest.raises(ValueError, match=r"x must be a row-major float \[M, 64\]"):
        nvfp4_linear(torch.randn(2, 32), packed, scale, rows)
    with pytest.raises(ValueError, match="K a multiple of 16"):
        nvfp4_linear(torch.randn(2, 40), packed[:, :20], scale[:, :2], rows)
    with pytest.raises(ValueError, match=r"row_scale must be float32 \[16\]"):
        nvfp4_linear(torch.randn(2, 64), packed, scale, rows[:8])
    with pytest.raises(ValueError, match="NVFP4 activations take whole groups of 16 columns"):
        quantize_nvfp4_activations(torch.randn(2, 40), torch.tensor(1.0))
    w13, s13, r13 = packed.view(1, 16, 32), scale.view(1, 16, 4), rows.view(1, 16)
    w2 = torch.zeros(1, 64, 4, dtype=torch.uint8)
    s2, r2 = torch.ones(1, 64, 1).to(torch.float8_e4m3fn), torch.ones(1, 64)
    x, weights, ids = torch.randn(1, 64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="NVFP4 ones their block and row scales"):
        fused_experts(x, w13, w2, weights, ids, scales=ExpertScales(s13, s2, (1, 16), (1, 16)))
    with pytest.raises(ValueError, match="NVFP4 experts need H and I multiples of 16, got H = 64, I = 8"):
        fused_experts(x, w13, w2, weights, ids, scales=ExpertScales(s13, s2, (1, 16), (1, 16), r13, r2))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("device", [on_cpu(id="interpreter"), on_gpu(id="cuda")])
def test_the_methods_run_the_kernels_as_their_references_multiply(mode: str, device: str) -> None:
    """Linear and experts methods with use_triton (the kernels) against the same layers on the
    reference path: the checkpoint's tensors reach the kernels as the reference reads them."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.moe.fused_moe import FusedMoE
    from tokenmill.quantization.format_base import EngineChoices
    from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Config, Nvfp4Encoder

    settings = {"quant_algo": "NVFP4"}
    gen = torch.Generator().manual_seed(4)
    layers = []
    for use_triton in (True, False):
        fmt = Nvfp4Config.from_settings(settings, use_triton, EngineChoices((10, 0), mode))
        torch.manual_seed(0)
        linear = Linear(64, [32, 16], bias=True, method=fmt.linear_method("qkv_proj"), dtype=torch.bfloat16)
        experts = FusedMoE(4, 64, 32, method=fmt.experts_method("mlp.experts"), dtype=torch.bfloat16)
        layers.append((linear.to(device), experts.to(device)))
    for i, rows in enumerate([32, 16]):
        tensors = Nvfp4Encoder().encode("", torch.randn(rows, 64, generator=gen) * 4**i,
                                        {"input_amax": torch.tensor(3.0 + i)})
        for linear, _ in layers:
            for suffix, tensor in tensors.items():
                getattr(linear, suffix).weight_loader(getattr(linear, suffix), tensor.to(device), i)
    for e in range(4):
        for projection, shape, stack in (("gate", (32, 64), "w13"), ("up", (32, 64), "w13"), ("down", (64, 32), "w2")):
            tensors = Nvfp4Encoder().encode("", torch.randn(shape, generator=gen), {"input_amax": torch.tensor(1.0)})
            for _, experts in layers:
                for suffix, tensor in tensors.items():
                    param = getattr(experts, stack if suffix == "weight" else f"{stack}_{suffix}")
                    param.weight_loader(param, tensor.to(device), (e, projection))
    x = torch.randn(5, 64, generator=gen).to(device, torch.bfloat16)
    (kernel_linear, kernel_experts), (ref_linear, ref_experts) = layers
    assert_close_rows(kernel_linear(x), ref_linear(x).float(), torch.bfloat16)
    ids = torch.randint(4, (5, 2), generator=gen, dtype=torch.int32).to(device)
    weights = torch.rand(5, 2, generator=gen).to(device)
    assert_close_rows(kernel_experts(x, weights, ids), ref_experts(x, weights, ids).float(), torch.bfloat16)

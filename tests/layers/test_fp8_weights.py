"""FP8 weight-only quantization of linear layers: one scale per output row, products equal to
the dequantized weight's, tied embeddings left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.quantization import quantize_fp8_


def test_rows_keep_their_largest_value_and_fp8_precision() -> None:
    torch.manual_seed(0)
    layer = Linear(256, 64, bias=False)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-3, 2, 64)[:, None])  # rows five decades apart
    original = layer.weight.detach().clone()
    quantize_fp8_(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64,)
    restored = layer.dequantized_weight()
    torch.testing.assert_close(restored.abs().amax(1), original.abs().amax(1), rtol=1e-6, atol=0)
    # E4M3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; below the
    # smallest normal (2^-6 of the scale unit) by at most half a subnormal step (2^-10 units).
    bound = torch.maximum(original.abs() * 2**-4, layer.weight_scale[:, None] * 2**-10)
    assert bool(((restored - original).abs() <= bound * 1.0001).all())


def test_product_equals_the_dequantized_weights() -> None:
    torch.manual_seed(1)
    layer = Linear(48, 20, bias=True)
    quantize_fp8_(layer)
    x = torch.randn(7, 48)
    expected = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    bf16 = Linear(48, 20, bias=True, dtype=torch.bfloat16)
    quantize_fp8_(bf16)
    assert bf16(x.bfloat16()).dtype == torch.bfloat16


def test_a_weight_wider_than_a_slab_is_dequantized_slab_by_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows beyond DEQUANT_ROWS (and a last, partial slab) give the whole dequantized weight's
    product, bias included, for 2-D and 3-D x."""
    import tokenmill.quantization.scaled_fp8 as linear

    monkeypatch.setattr(linear, "DEQUANT_ROWS", 8)
    torch.manual_seed(3)
    layer = Linear(24, 21, bias=True)
    quantize_fp8_(layer)
    for x in (torch.randn(5, 24), torch.randn(2, 3, 24)):
        expected = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = Linear(16, 16, bias=False)
        self.head = Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight


def test_model_quantization_copies_a_tied_head_and_keeps_the_embedding() -> None:
    torch.manual_seed(2)
    model = TiedModel()
    embedding = model.embed.weight.detach().clone()
    assert quantize_fp8_(model) == 2
    assert model.embed.weight.dtype == torch.float32 and torch.equal(model.embed.weight, embedding)
    assert model.head.weight.dtype == model.proj.weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(model.head.dequantized_weight(), embedding, rtol=2**-4, atol=1e-3)
    before = model.head.weight
    quantize_fp8_(model.head)  # twice is once
    assert model.head.weight is before
    assert "head.weight_scale" in model.state_dict()

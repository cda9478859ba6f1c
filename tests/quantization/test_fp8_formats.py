"""The FP8-element formats (per-tensor / per-channel FP8, 128 x 128 block FP8, MXFP8) on the CPU:
what an encoder writes loads through the format's methods into fused layers and stacked experts
and dequantizes to the same weights bit for bit; products equal torch's on those weights."""

from __future__ import annotations

import pytest
import torch

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.numerics import MX_GROUP, dequantize_blocks
from tokenmill.quantization.registry import ENCODERS, FORMATS
from tokenmill.quantization.unquantized_experts import fused_experts_ref

SETTINGS = {"fp8": {"quant_algo": "FP8"}, "fp8-block": {"quant_algo": "FP8_BLOCK", "weight_block_size": [128, 128]},
            "mxfp8": {"quant_algo": "MXFP8"}}
BLOCKS = {"fp8": (1, 0), "fp8-block": (128, 128), "mxfp8": (1, MX_GROUP)}
SCALE = {"fp8": "weight_scale", "fp8-block": "weight_scale_inv", "mxfp8": "weight_scale"}


def encoded(fmt: str, weight: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    calibration = {"input_amax": torch.tensor(3.0 + seed)}
    return ENCODERS[fmt]().encode("layer", weight, calibration)


def real_weight(fmt: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight the encoder meant, dequantized by the format's definition."""
    scale = tensors[SCALE[fmt]]
    return dequantize_blocks(tensors["weight"], scale.reshape(-1, 1) if scale.dim() < 2 else scale, BLOCKS[fmt])


def fmt_config(fmt: str):
    return FORMATS[SETTINGS[fmt]["quant_algo"]].from_settings(SETTINGS[fmt], use_triton=False)


@pytest.mark.parametrize("fmt", list(SETTINGS))
@pytest.mark.parametrize("sizes", [[96, 32, 32], [256, 128, 128], [200]], ids=["unaligned", "aligned", "one"])
def test_fused_shards_with_their_own_scales_load_exactly(fmt: str, sizes: list[int]) -> None:
    """Each shard of a fused layer keeps its own scales (per-tensor scales that differ by
    shard, 128-row blocks whose shards do not start on a block row)."""
    torch.manual_seed(0)
    k = 160
    layer = Linear(k, sizes, bias=False, method=fmt_config(fmt).linear_method("qkv_proj"))
    expected = []
    for i, rows in enumerate(sizes):
        weight = torch.randn(rows, k) * (i + 1) ** 3  # very different ranges per shard
        tensors = encoded(fmt, weight, i)
        expected.append(real_weight(fmt, tensors))
        for suffix, tensor in tensors.items():
            param = getattr(layer, suffix)
            param.weight_loader(param, tensor, i if len(sizes) > 1 else None)
    assert torch.equal(layer.dequantized_weight(), torch.cat(expected))
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ torch.cat(expected).T, rtol=1e-5, atol=1e-4)
    assert (layer.weight.float() - expected[0].new_zeros(1)).abs().max() <= 448


@pytest.mark.parametrize("fmt", list(SETTINGS))
def test_dequantization_error_is_that_of_the_format(fmt: str) -> None:
    """E4M3 keeps 3 mantissa bits: relative error <= 2^-4 of each scale group's range."""
    torch.manual_seed(1)
    weight = torch.randn(256, 256)
    error = (real_weight(fmt, encoded(fmt, weight)) - weight).abs()
    assert error.max() <= weight.abs().max() * 2**-4
    assert error.mean() < 0.03 * weight.abs().mean()


@pytest.mark.parametrize("fmt", list(SETTINGS))
@pytest.mark.parametrize("inter", [64, 128], ids=["unaligned", "aligned"])
def test_stacked_experts_load_per_expert_and_match_the_reference(fmt: str, inter: int) -> None:
    torch.manual_seed(2)
    experts, hidden = 4, 96
    layer = FusedMoE(experts, hidden, inter, method=fmt_config(fmt).experts_method("mlp.experts"))
    w13, w2 = torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    for e in range(experts):
        for projection, rows, dest, stack in (("gate", slice(0, inter), w13, "w13"), ("up", slice(inter, None), w13, "w13"),
                                              ("down", slice(None), w2, "w2")):
            tensors = encoded(fmt, torch.randn(dest.shape[1:])[rows] * (e + 1), e)
            dest[e, rows] = real_weight(fmt, tensors)
            for suffix, tensor in tensors.items():
                if suffix == "input_scale":
                    continue
                name = stack if suffix == "weight" else f"{stack}_{suffix}"
                param = getattr(layer, name)
                param.weight_loader(param, tensor, (e, projection))
    got13, got2 = layer.dequantized_weights()
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    x = torch.randn(7, hidden)
    ids = torch.randint(experts, (7, 2), dtype=torch.int32)
    weights = torch.rand(7, 2)
    torch.testing.assert_close(layer(x, weights, ids), fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fp8_weights_refuse_unquantized_tensors_and_mx_needs_whole_groups() -> None:
    layer = Linear(64, 32, bias=False, method=fmt_config("fp8").linear_method("o_proj"))
    with pytest.raises(ModelLoadError, match="stores torch.float32 where the model's layer holds torch.float8_e4m3fn"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 64), None)
    plain = Linear(64, 32, bias=False)
    with pytest.raises(ModelLoadError, match="quantization config does not describe this layer"):
        plain.weight.weight_loader(plain.weight, torch.zeros(32, 64, dtype=torch.float8_e4m3fn), None)
    with pytest.raises(ConfigError, match="down_proj: 80 input columns are not a multiple of the 32-column"):
        Linear(80, 32, bias=False, method=fmt_config("mxfp8").linear_method("down_proj"))

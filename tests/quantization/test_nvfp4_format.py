"""NVFP4 on the CPU: what the encoder writes loads through the format's methods into fused layers
(shards with different global scales) and stacked experts (gate and up with different global
scales) and dequantizes to the same weights bit for bit; products equal torch's on them; the
W4A4 / W4A16 choice by device, and the refusals."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.numerics import E2M1_VALUES, dequantize_nvfp4, quantize_nvfp4
from tokenmill.quantization.format_base import EngineChoices
from tokenmill.quantization.nvfp4 import fake_quantized_input
from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Encoder
from tokenmill.quantization.registry import FORMATS
from tokenmill.quantization.unquantized_experts import fused_experts_ref

NVFP4 = {"quant_algo": "NVFP4", "group_size": 16, "where": "hf_quant_config.json quantization.quant_algo"}
W4A16 = {"quant_algo": "W4A16_NVFP4", "group_size": 16, "where": "hf_quant_config.json quantization.quant_algo"}
HOPPER, BLACKWELL = EngineChoices((9, 0)), EngineChoices((10, 0), "w4a4")  # W4A4 runs only when asked for


def fmt(settings: dict = NVFP4, choices: EngineChoices = EngineChoices()):
    return FORMATS[settings["quant_algo"]].from_settings(settings, False, choices)


def encoded(weight: torch.Tensor, input_amax: float = 3.0, weight_amax: float | None = None) -> dict[str, torch.Tensor]:
    calibration = {"input_amax": torch.tensor(input_amax)}
    if weight_amax is not None:
        calibration["weight_amax"] = torch.tensor(weight_amax)
    return Nvfp4Encoder().encode("layer", weight, calibration)


def real_weight(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight the encoder meant, by the format's definition: e2m1 * weight_scale * weight_scale_2."""
    return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"])


def load(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], shard, stack: str | None = None) -> None:
    for suffix, tensor in tensors.items():
        name = suffix if stack is None else (stack if suffix == "weight" else f"{stack}_{suffix}")
        param = getattr(layer, name)
        param.weight_loader(param, tensor, shard)


def test_the_encoding_is_modelopts() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    tensors = encoded(weight, input_amax=5.0)
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (32, 32)
    assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (32, 4)
    assert tensors["weight_scale_2"].shape == () and tensors["weight_scale_2"] == weight.abs().amax() / (6 * 448)
    assert tensors["input_scale"] == torch.tensor(5.0) / (6 * 448)
    blocks = weight.view(32, 4, 16).abs().amax(-1)
    expected = (blocks / (6 * tensors["weight_scale_2"])).clamp(2**-9, 448).to(torch.float8_e4m3fn)
    assert torch.equal(tensors["weight_scale"].float(), expected.float())
    error = (real_weight(tensors) - weight).abs()
    step = tensors["weight_scale"].float().repeat_interleave(16, 1) * tensors["weight_scale_2"]
    assert (error <= step * 1.0001).all()  # at most half of E2M1's widest step (2) in each group's scale
    assert error.mean() < 0.1 * weight.abs().mean()


def test_two_elements_a_byte_the_even_one_low_and_ties_to_even() -> None:
    """Under a global scale of 2^-8 a group whose amax is 6 has block scale 256, so its elements
    are encoded as they are: each midpoint rounds to the even code, -0.0 keeps its sign."""
    row = [6.0, 1.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0]
    packed, scale = quantize_nvfp4(torch.tensor([row]), torch.tensor(2.0**-8))
    assert scale.float().item() == 256.0
    assert packed[0, 0].item() == 0x27  # 6.0 is code 7, in the low nibble; 1.0 is code 2
    assert packed[0, 4].item() >> 4 == 8  # -0.0
    decoded = dequantize_nvfp4(packed, scale, torch.tensor(2.0**-8))[0].tolist()
    assert decoded == [6.0, 1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0]
    assert set(abs(v) for v in decoded) <= set(E2M1_VALUES)


@pytest.mark.parametrize("sizes", [[64, 32, 32], [48]], ids=["qkv", "one"])
def test_fused_shards_with_their_own_global_scales_load_exactly(sizes: list[int]) -> None:
    torch.manual_seed(1)
    k = 80  # 5 groups of 16
    layer = Linear(k, sizes, bias=False, method=fmt().linear_method("qkv_proj"))
    expected = []
    for i, rows in enumerate(sizes):
        tensors = encoded(torch.randn(rows, k) * 10.0 ** (2 * i), input_amax=1.0 + i)
        expected.append(real_weight(tensors))
        load(layer, tensors, i if len(sizes) > 1 else None)
    assert len({layer.weight_scale_2[sum(sizes[:i])].item() for i in range(len(sizes))}) == len(sizes)
    assert torch.equal(layer.dequantized_weight(), torch.cat(expected))
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ torch.cat(expected).T, rtol=1e-5, atol=1e-4 * 10.0 ** (2 * len(sizes)))
    assert layer.input_scale.tolist() == pytest.approx([(1.0 + i) / 2688 for i in range(len(sizes))])


@pytest.mark.parametrize("shared", [True, False], ids=["modelopt-shared", "distinct"])
def test_stacked_experts_load_per_expert_and_match_the_reference(shared: bool) -> None:
    """ModelOpt gives an expert's gate and up one weight_scale_2; distinct ones load exactly too."""
    torch.manual_seed(2)
    experts, hidden, inter = 4, 64, 48
    layer = FusedMoE(experts, hidden, inter, method=fmt().experts_method("mlp.experts"))
    w13, w2 = torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    for e in range(experts):
        gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden) * 30, torch.randn(hidden, inter)
        amax = torch.cat([gate, up]).abs().amax().item() if shared else None
        for projection, weight, dest, rows, stack in (("gate", gate, w13, slice(0, inter), "w13"),
                                                      ("up", up, w13, slice(inter, None), "w13"),
                                                      ("down", down, w2, slice(None), "w2")):
            tensors = encoded(weight, weight_amax=amax if projection != "down" else None)
            dest[e, rows] = real_weight(tensors)
            load(layer, tensors, (e, projection), stack)
    assert (layer.w13_weight_scale_2[:, 0] == layer.w13_weight_scale_2[:, inter]).all() == shared
    got13, got2 = layer.dequantized_weights()
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    x = torch.randn(7, hidden)
    ids = torch.randint(experts, (7, 2), dtype=torch.int32)
    weights = torch.rand(7, 2)
    torch.testing.assert_close(layer(x, weights, ids), fused_experts_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-4)


def test_w4a4_quantizes_the_activations_per_16_under_the_input_scale() -> None:
    torch.manual_seed(3)
    layer = Linear(64, [32, 16], bias=True, method=fmt(NVFP4, BLACKWELL).linear_method("gate_up_proj"))
    assert layer.method.activations == "w4a4"
    for i, rows in enumerate([32, 16]):
        load(layer, encoded(torch.randn(rows, 64), input_amax=4.0 + i), i)
    x = torch.randn(3, 64) * 2
    input_scale = torch.tensor(5.0 / 2688)  # the larger of the shards' input scales
    seen = fake_quantized_input(x, input_scale)
    packed, scale = quantize_nvfp4(x, input_scale)
    assert torch.equal(seen, dequantize_nvfp4(packed, scale, input_scale)) and not torch.equal(seen, x)
    torch.testing.assert_close(layer(x), seen @ layer.dequantized_weight().T + layer.bias, rtol=1e-5, atol=1e-5)
    w4a16 = Linear(64, [32, 16], bias=True, method=fmt(NVFP4, HOPPER).linear_method("gate_up_proj"))
    w4a16.load_state_dict(layer.state_dict())
    torch.testing.assert_close(w4a16(x), x @ layer.dequantized_weight().T + layer.bias, rtol=1e-5, atol=1e-5)


def test_the_activation_mode_follows_the_device_and_fails_closed(caplog: pytest.LogCaptureFixture) -> None:
    assert fmt(NVFP4, BLACKWELL).activations == "w4a4"
    assert fmt(NVFP4, EngineChoices((12, 1), "w4a4")).activations == "w4a4"
    assert fmt(NVFP4, EngineChoices((10, 0))).activations == "w4a16"  # auto: W4A4 has no FP4 MMA kernel yet
    assert fmt(NVFP4, EngineChoices((10, 0), "w4a16")).activations == "w4a16"
    assert fmt(W4A16, EngineChoices((10, 0))).activations == "w4a16"
    with caplog.at_level(logging.INFO):
        assert fmt({**NVFP4, "where": "a hopper checkpoint"}, HOPPER).activations == "w4a16"
    assert "input scales are loaded but unused" in caplog.text
    with pytest.raises(ConfigError, match=r"--nvfp4-mode w4a4 needs FP4 tensor cores .* this device is sm_90; use "
                                          r"--nvfp4-mode w4a16"):
        fmt(NVFP4, EngineChoices((9, 0), "w4a4"))
    with pytest.raises(ConfigError, match="this device is not a GPU"):
        fmt(NVFP4, EngineChoices(None, "w4a4"))
    with pytest.raises(ConfigError, match="is W4A16_NVFP4 \\(no input_scale\\); use --nvfp4-mode auto or w4a16"):
        fmt(W4A16, EngineChoices((10, 0), "w4a4"))
    with pytest.raises(ConfigError, match="group_size = 32 is not supported for NVFP4"):
        fmt({**NVFP4, "group_size": 32})


def test_refusals_name_what_to_change() -> None:
    with pytest.raises(ConfigError, match="o_proj: 72 input columns are not a multiple of NVFP4's 16-column"):
        Linear(72, 32, bias=False, method=fmt().linear_method("o_proj"))
    layer = Linear(64, 32, bias=False, method=fmt().linear_method("o_proj"))
    with pytest.raises(ModelLoadError, match="stores torch.float32 where the model's layer holds torch.uint8"):
        layer.weight.weight_loader(layer.weight, torch.randn(32, 32), None)
    with pytest.raises(ModelLoadError, match="weight_scale_2 of 3 values where one per tensor is read"):
        layer.weight_scale_2.weight_loader(layer.weight_scale_2, torch.ones(3), None)
    with pytest.raises(ConfigError, match="mlp.experts: 40 input columns are not a multiple"):
        FusedMoE(2, 64, 40, method=fmt().experts_method("mlp.experts"))
    w4a16 = Linear(64, 32, bias=False, method=fmt(W4A16).linear_method("o_proj"))
    assert not hasattr(w4a16, "input_scale")

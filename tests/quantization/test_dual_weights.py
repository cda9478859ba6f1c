"""Dual weights: a step of fewer than the threshold's tokens multiplies the NVFP4 copy, a bigger one
the second copy (FP8 rows or MXFP8), each equal to its own oracle; the copies come from an NVFP4
checkpoint (the second from its dequantized weights) or from a high-precision one (both
quantized at load); start-up sizes the model with both; the engine picks per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.numerics import MX_GROUP, dequantize_blocks, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from tokenmill.quantization.checkpoint import CheckpointQuantization
from tokenmill.quantization.detect import read_quant_spec
from tokenmill.quantization.dual import DualFusedMoEMethod, DualLinearMethod, DualWeights, fp8_rows_encode
from tokenmill.quantization.mxfp8 import MxFp8Encoder
from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Encoder
from tokenmill.quantization.unquantized_experts import fused_experts_ref
from tokenmill.quantize.writer import QuantizeRequest, quantize_checkpoint
from tokenmill.runner.model_builder import model_weight_bytes

NVFP4_SPEC = read_quant_spec(None, {"quantization": {"quant_algo": "NVFP4", "group_size": 16}})
SIZES, K = [64, 32, 32], 96


def second_oracle(second: str, weight: torch.Tensor) -> torch.Tensor:
    """The second copy a float32 weight [rows, K] gets, by its format's definition."""
    if second == "fp8":
        tensors = fp8_rows_encode(weight)
        return tensors["weight"].float() * tensors["weight_scale"][:, None]
    tensors = MxFp8Encoder().encode("", weight, {})
    return dequantize_blocks(tensors["weight"], tensors["weight_scale"], (1, MX_GROUP))


def spy(method, name: str, calls: list[tuple[str, int]]):
    inner = method.apply

    def apply(layer, x, *args):
        calls.append((name, x.shape[0]))
        return inner(layer, x, *args)

    method.apply = apply


def nvfp4_layer(second: str, threshold: int = 41) -> tuple[Linear, torch.Tensor]:
    """A fused layer of an NVFP4 checkpoint (shards with their own global scales) with dual weights."""
    config = DualWeights(CheckpointQuantization(NVFP4_SPEC), second, threshold)
    layer = Linear(K, SIZES, bias=True, method=config.linear_method("qkv_proj"))
    for i, rows in enumerate(SIZES):
        tensors = Nvfp4Encoder().encode("", torch.randn(rows, K) * 3.0 ** i, {"input_amax": torch.tensor(1.0)})
        for suffix, tensor in tensors.items():
            getattr(layer, suffix).weight_loader(getattr(layer, suffix), tensor, i)
    nvfp4 = layer.dequantized_weight()
    layer.method.process_weights_after_loading(layer)
    return layer, nvfp4


@pytest.mark.parametrize("second", ["fp8", "mxfp8"])
def test_small_steps_use_the_nvfp4_copy_and_big_ones_the_second(second: str) -> None:
    torch.manual_seed(0)
    layer, nvfp4 = nvfp4_layer(second)
    method = layer.method
    assert isinstance(method, DualLinearMethod)
    calls: list[tuple[str, int]] = []
    spy(method.first, "nvfp4", calls)
    spy(method.second, second, calls)
    # The second copy: the NVFP4 weights dequantized and quantized again, shard by shard.
    oracle = torch.cat([second_oracle(second, part) for part in nvfp4.split(SIZES)])
    assert torch.equal(method.second.dequantized_weight(layer.second_copy), oracle)
    assert not torch.equal(oracle, nvfp4)
    for tokens in (1, 40, 41, 300):
        x = torch.randn(tokens, K)
        expected = x @ (nvfp4 if tokens <= 40 else oracle).T + layer.bias
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert calls == [("nvfp4", 1), ("nvfp4", 40), (second, 41), (second, 300)]
    assert torch.equal(layer.dequantized_weight(), nvfp4)


def test_a_high_precision_checkpoint_is_quantized_to_both_copies_at_load() -> None:
    torch.manual_seed(1)
    config = DualWeights(None, "fp8", 8)
    layer = Linear(K, SIZES, bias=False, method=config.linear_method("model.layers.0.self_attn.qkv_proj"))
    weight = torch.randn(sum(SIZES), K) * torch.tensor([1.0, 30.0, 0.1]).repeat_interleave(torch.tensor(SIZES))[:, None]
    layer.weight.data.copy_(weight)
    layer.method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.uint8 and layer.second_copy.weight.dtype == torch.float8_e4m3fn
    parts = weight.split(SIZES)
    nvfp4 = []
    for part in parts:
        g = nvfp4_global_scale(part.abs().amax())
        nvfp4.append(dequantize_nvfp4(*quantize_nvfp4(part, g), g))
    assert torch.equal(layer.dequantized_weight(), torch.cat(nvfp4))
    assert torch.equal(layer.method.second.dequantized_weight(layer.second_copy),
                       torch.cat([second_oracle("fp8", part) for part in parts]))
    x = torch.randn(8, K)
    torch.testing.assert_close(layer(x), x @ torch.cat([second_oracle("fp8", p) for p in parts]).T, rtol=1e-5, atol=1e-4)
    assert not isinstance(config.linear_method("lm_head"), DualLinearMethod)  # the head and routers keep one copy
    assert not isinstance(config.linear_method("model.layers.0.mlp.gate"), DualLinearMethod)


@pytest.mark.parametrize("source", ["nvfp4", "high-precision"])
def test_experts_pick_their_copy_by_the_tokens_of_the_step(source: str) -> None:
    torch.manual_seed(2)
    experts, hidden, inter = 4, 64, 32
    base = CheckpointQuantization(NVFP4_SPEC) if source == "nvfp4" else None
    layer = FusedMoE(experts, hidden, inter, method=DualWeights(base, "fp8", 41).experts_method("mlp.experts"))
    method = layer.method
    assert isinstance(method, DualFusedMoEMethod)
    if source == "nvfp4":
        for e in range(experts):
            for projection, shape, stack in (("gate", (inter, hidden), "w13"), ("up", (inter, hidden), "w13"),
                                             ("down", (hidden, inter), "w2")):
                tensors = Nvfp4Encoder().encode("", torch.randn(shape), {"input_amax": torch.tensor(1.0)})
                for suffix, tensor in tensors.items():
                    param = getattr(layer, stack if suffix == "weight" else f"{stack}_{suffix}")
                    param.weight_loader(param, tensor, (e, projection))
    else:
        layer.w13.data.normal_()
        layer.w2.data.normal_()
    source13, source2 = (t.clone() for t in layer.dequantized_weights())  # what the second copy is made from
    method.process_weights_after_loading(layer)
    w13, w2 = layer.dequantized_weights()
    assert layer.w13.dtype == torch.uint8 and torch.equal(source13, w13) == (source == "nvfp4")
    s13 = torch.stack([torch.cat([second_oracle("fp8", source13[e, :inter]), second_oracle("fp8", source13[e, inter:])])
                       for e in range(experts)])
    s2 = torch.stack([second_oracle("fp8", source2[e]) for e in range(experts)])
    calls: list[tuple[str, int]] = []
    spy(method.first, "nvfp4", calls)
    spy(method.second, "fp8", calls)
    for tokens in (3, 41):
        x = torch.randn(tokens, hidden)
        ids = torch.randint(experts, (tokens, 2), dtype=torch.int32)
        weights = torch.rand(tokens, 2)
        expected = fused_experts_ref(x, *((w13, w2) if tokens < 41 else (s13, s2)), weights, ids)
        torch.testing.assert_close(layer(x, weights, ids), expected, rtol=1e-5, atol=1e-4)
    assert calls == [("nvfp4", 3), ("fp8", 41)]


@pytest.mark.parametrize("arch,source", [("llama", "nvfp4"), ("qwen3_moe", "nvfp4"), ("qwen3_moe", "high-precision")])
def test_the_engine_sizes_both_copies_and_picks_one_per_step(tmp_path: Path, arch: str, source: str) -> None:
    save_tiny_checkpoint(arch, tmp_path / "hp")
    if source == "nvfp4":
        quantize_checkpoint(QuantizeRequest(str(tmp_path / "hp"), "nvfp4", tmp_path / "nvfp4", calibration_tokens=32,
                                            progress=False))
    llm = LLM(str(tmp_path / ("nvfp4" if source == "nvfp4" else "hp")), device="cpu", max_model_len=128,
              kv_cache_bytes=1 << 22, dual_weights="nvfp4+fp8", dual_weights_threshold=41)
    runner = llm.engine.runner
    model = runner.model
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    sized = model_weight_bytes(runner.build, runner.dtype)  # before loading: the second copies included
    assert sized == held if source == "nvfp4" else sized > held  # a high-precision load's peak is its float weights
    layer = model.model.layers[0]
    duals = [layer.self_attn.qkv_proj.method, (layer.mlp.experts if arch == "qwen3_moe" else layer.mlp.gate_up_proj).method]
    assert all(isinstance(m, (DualLinearMethod, DualFusedMoEMethod)) for m in duals)
    calls: list[tuple[str, int]] = []
    for method in duals:
        spy(method.first, "nvfp4", calls)
        spy(method.second, "fp8", calls)
    prompt = list(range(1, 61))
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    assert len(out) == 4
    assert {name for name, tokens in calls if tokens >= 41} == {"fp8"} and {"nvfp4"} == {n for n, t in calls if t < 41}
    assert [t for name, t in calls if name == "fp8"] == [60, 60]
    if source == "nvfp4":  # steps below the threshold multiply exactly what the NVFP4-only engine does
        single = LLM(str(tmp_path / "nvfp4"), device="cpu", max_model_len=128, kv_cache_bytes=1 << 22)
        short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert llm.generate([prompt[:30]], short)[0].outputs == single.generate([prompt[:30]], short)[0].outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_nvfp4_and_dual_weights_on_cuda_replay_their_graphs(tmp_path: Path, arch: str) -> None:
    """On CUDA the NVFP4 kernels (and the dual model's FP8 prefill) run inside the decode graphs:
    graphs give the eager engine's greedy tokens, and a dual model's short prompts the
    NVFP4-only model's."""
    save_tiny_checkpoint(arch, tmp_path / "hp")
    quantize_checkpoint(QuantizeRequest(str(tmp_path / "hp"), "nvfp4", tmp_path / "nvfp4", calibration_tokens=32,
                                        progress=False))
    common = dict(device="cuda", dtype="bfloat16", max_model_len=256, kv_cache_bytes=1 << 24)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 17, 30, 120)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, alone = {}, {}
    for name, options in (("graphs", {}), ("eager", {"enforce_eager": True}), ("dual", {"dual_weights": "nvfp4+fp8"})):
        llm = LLM(str(tmp_path / "nvfp4"), **common, **options)
        assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.method.use_triton
        # One short prompt at a time, first (before a batched step of 41 tokens or more has filled the
        # prefix cache with KV from the dual model's second copy): every step has fewer than 41 tokens.
        alone[name] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:3]]
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["graphs"] == tokens["eager"] and alone["graphs"] == alone["eager"]
    assert alone["dual"] == alone["graphs"]  # steps below the threshold never touch the FP8 copy
    assert all(len(t) == 16 for t in tokens["dual"])


def test_dual_weights_refuse_other_checkpoints_and_uneven_columns() -> None:
    fp8 = CheckpointQuantization(read_quant_spec(None, {"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ConfigError, match="made from an NVFP4 or a high-precision checkpoint; this one is FP8"):
        DualWeights(fp8, "fp8", 41)
    with pytest.raises(ConfigError, match="down_proj: 80 input columns are not a multiple of the 32-column groups of "
                                          "its mxfp8 copy"):
        Linear(80, 64, bias=False, method=DualWeights(None, "mxfp8", 41).linear_method("down_proj"))
    with pytest.raises(ConfigError, match="unknown --dual-weights 'nvfp4\\+int8'"):
        LLM(None, device="cpu", dual_weights="nvfp4+int8")

"""`tokenmill quantize` end to end on tiny random Llama and Qwen3-MoE checkpoints: the on-disk
tensors round-trip exactly (what the format's definition dequantizes them to is what the loaded
engine multiplies by, bit for bit), greedy generation equals a model holding the dequantized
weights, --draft quantizes the head on the quantized body's activations, --exclude keeps
layers, and the refusals name what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from tokenmill.cli import main
from tokenmill.errors import ConfigError
from tokenmill.llm import LLM
from tokenmill.numerics import MX_GROUP, dequantize_blocks, dequantize_nvfp4
from tokenmill.quantize.writer import QuantizeRequest, quantize_checkpoint
from tokenmill.sampling_params import SamplingParams

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)
CONFIGS = {
    "llama": LlamaConfig(**COMMON, intermediate_size=128, tie_word_embeddings=False),
    "llama-tied": LlamaConfig(**COMMON, intermediate_size=128, tie_word_embeddings=True),
    "qwen3_moe": Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False),
}
FORMATS = {"fp8": ("weight_scale", (1, 0)), "fp8-block": ("weight_scale_inv", (128, 128)),
           "mxfp8": ("weight_scale", (1, MX_GROUP)), "nvfp4": ("weight_scale_2", None)}
SCALES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale")
ERROR_BOUND = {"fp8": 2**-4, "fp8-block": 2**-4, "mxfp8": 2**-4, "nvfp4": 0.2}  # of each weight's amax
PROMPTS = [[1, 5, 9, 200, 17], [3] * 11]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.08) if param.dim() > 1 else param.normal_(1.0, 0.1)
        found[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(found[name])
    return found


def quantized(checkpoints: dict[str, Path], name: str, fmt: str, *extra: str) -> Path:
    out = checkpoints[name].parent / f"{checkpoints[name].name}-{fmt}{'-'.join(extra)}"
    if not out.exists():
        assert main(["quantize", str(checkpoints[name]), "--format", fmt, "--out", str(out), "--calibration-tokens", "48",
                     "--no-progress", *extra]) == 0
    return out


def on_disk_dequantized(directory: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Each quantized module's weight as the format's definition dequantizes its stored tensors."""
    scale_name, block = FORMATS[fmt]
    tensors = load_file(str(directory / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(f".{scale_name}") and block is None:  # NVFP4: e2m1 * weight_scale * weight_scale_2
            module = name.removesuffix(f".{scale_name}")
            out[module] = dequantize_nvfp4(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"], tensor)
        elif name.endswith(f".{scale_name}"):
            module = name.removesuffix(f".{scale_name}")
            scale = tensor.reshape(-1, 1) if tensor.dim() < 2 else tensor
            out[module] = dequantize_blocks(tensors[f"{module}.weight"], scale.expand(tensors[f"{module}.weight"].shape[0], -1)
                                            if tensor.numel() == 1 else scale, block)
    return out


def dequantized_oracle(directory: Path, fmt: str, out: Path) -> Path:
    """The same checkpoint with every quantized layer stored as its dequantized float32 weight."""
    tensors = load_file(str(directory / "model.safetensors"))
    weights = {name: t for name, t in tensors.items() if not name.endswith(SCALES)}
    weights.update({f"{module}.weight": w for module, w in on_disk_dequantized(directory, fmt).items()})
    out.mkdir(exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def greedy(directory: Path) -> list[list[int]]:
    llm = LLM(str(directory), device="cpu", max_model_len=128, kv_cache_bytes=1 << 22)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_quantized_checkpoint_generates_as_its_dequantized_weights(checkpoints, tmp_path: Path, name: str, fmt: str) -> None:
    directory = quantized(checkpoints, name, fmt)
    assert greedy(directory) == greedy(dequantized_oracle(directory, fmt, tmp_path / "oracle"))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_on_disk_format_round_trips_bit_for_bit(checkpoints, fmt: str) -> None:
    """The loaded engine's weights (fused q/k/v and gate/up, stacked experts) equal what the
    stored tensors dequantize to, and the encoding stays within its format's error of the original."""
    directory = quantized(checkpoints, "qwen3_moe", fmt)
    stored = on_disk_dequantized(directory, fmt)
    model = LLM(str(directory), device="cpu", max_model_len=64, kv_cache_bytes=1 << 20).engine.runner.model
    layer = model.model.layers[0]
    attention = layer.self_attn.qkv_proj.dequantized_weight()
    assert torch.equal(attention, torch.cat([stored[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]))
    w13, w2 = layer.mlp.experts.dequantized_weights()
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(w13[e], torch.cat([stored[f"{prefix}.gate_proj"], stored[f"{prefix}.up_proj"]]))
        assert torch.equal(w2[e], stored[f"{prefix}.down_proj"])
    original = load_file(str(checkpoints["qwen3_moe"] / "model.safetensors"))
    for module, weight in stored.items():
        error = (weight - original[f"{module}.weight"]).abs().max()
        assert error <= original[f"{module}.weight"].abs().max() * ERROR_BOUND[fmt], module
    assert "lm_head.weight" in load_file(str(directory / "model.safetensors"))  # the head is kept


@pytest.mark.parametrize("fmt,dtype", [("fp8", torch.float8_e4m3fn), ("nvfp4", torch.uint8)])
def test_draft_mode_quantizes_a_tied_head_on_the_quantized_body(checkpoints, fmt: str, dtype: torch.dtype) -> None:
    directory = quantized(checkpoints, "llama-tied", fmt, "--draft")
    tensors = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and tensors["lm_head.weight"].dtype == dtype
    assert tensors["lm_head.input_scale"] > 0 and "model.embed_tokens.weight" in tensors
    assert greedy(directory) == greedy(dequantized_oracle(directory, fmt, directory.parent / f"tied-oracle-{fmt}"))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_quantized_draft_model_loads_through_the_same_detection(checkpoints, fmt: str) -> None:
    draft = quantized(checkpoints, "llama", fmt)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(str(checkpoints["llama"]), device="cpu", max_model_len=128, kv_cache_bytes=1 << 22, speculative_config=spec)
    assert llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match=rf"the draft checkpoint is already quantized \({fmt.upper()}.*\); drop"):
        LLM(str(checkpoints["llama"]), device="cpu", max_model_len=128, kv_cache_bytes=1 << 22,
            speculative_config={**spec, "quantization": "fp8"})


def test_an_nvfp4_checkpoint_asked_for_w4a4_off_blackwell_fails_at_start_up(checkpoints) -> None:
    directory = quantized(checkpoints, "llama", "nvfp4")
    with pytest.raises(ConfigError, match="--nvfp4-mode w4a4 needs FP4 tensor cores .* this device is not a GPU"):
        LLM(str(directory), device="cpu", max_model_len=64, kv_cache_bytes=1 << 20, nvfp4_mode="w4a4")
    layer = LLM(str(directory), device="cpu", max_model_len=64, kv_cache_bytes=1 << 20).engine.runner.model.lm_head
    assert layer.weight.dtype == torch.float32  # the head stays as the checkpoint stores it


def test_exclude_keeps_matching_layers_in_the_checkpoint_dtype(checkpoints) -> None:
    directory = quantized(checkpoints, "llama", "fp8-block", "--exclude", "model.layers.1.*")
    tensors = load_file(str(directory / "model.safetensors"))
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert greedy(directory) == greedy(dequantized_oracle(directory, "fp8-block", directory.parent / "exclude-oracle"))


def test_refusals_say_what_to_change(checkpoints, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--format int4: this build of tokenmill has no int4 encoder"):
        quantize_checkpoint(QuantizeRequest(str(checkpoints["llama"]), "int4", tmp_path / "x"))
    with pytest.raises(ConfigError, match="is already quantized; quantize its high-precision original"):
        quantize_checkpoint(QuantizeRequest(str(quantized(checkpoints, "llama", "fp8")), "mxfp8", tmp_path / "y"))
    odd = LlamaConfig(**{**COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
                      intermediate_size=80)
    AutoModelForCausalLM.from_config(odd).save_pretrained(tmp_path / "odd")
    with pytest.raises(ConfigError, match=r"down_proj: 80 input columns are not a multiple of 32.*--exclude"):
        quantize_checkpoint(QuantizeRequest(str(tmp_path / "odd"), "mxfp8", tmp_path / "z", progress=False,
                                            calibration_tokens=8))
    AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, intermediate_size=72)).save_pretrained(tmp_path / "odd16")
    with pytest.raises(ConfigError, match=r"down_proj: 72 input columns are not a multiple of 16, which NVFP4 needs"):
        quantize_checkpoint(QuantizeRequest(str(tmp_path / "odd16"), "nvfp4", tmp_path / "w", progress=False,
                                            calibration_tokens=8))


def test_mixed_precision_checkpoint_with_mxfp8_experts_beside_a_high_precision_body(checkpoints, tmp_path: Path) -> None:
    """ModelOpt MIXED_PRECISION: a per-layer map names the MXFP8 experts; everything else loads as stored."""
    directory = quantized(checkpoints, "qwen3_moe", "mxfp8", "--exclude", "*.self_attn.*")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(tensors, str(mixed / "model.safetensors"))
    experts = sorted({name.removesuffix(".weight_scale") for name in tensors if ".experts." in name and "scale" in name})
    layers = {name: {"quant_algo": "MXFP8"} for name in experts}
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (mixed / "config.json").write_text(json.dumps(config))
    (mixed / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"],
        "quantized_layers": layers}}))
    assert len(experts) == 2 * 4 * 3
    assert greedy(mixed) == greedy(dequantized_oracle(directory, "mxfp8", tmp_path / "oracle"))


def test_a_draft_vocabulary_over_a_quantized_head_is_refused(checkpoints, tmp_path: Path) -> None:
    draft = quantized(checkpoints, "llama-tied", "fp8", "--draft")
    vocab = tmp_path / "ids.txt"
    vocab.write_text("\n".join(str(i) for i in range(64)))
    spec = {"method": "draft_model", "model": str(draft), "draft_vocab": str(vocab)}
    with pytest.raises(ConfigError, match="stores that head quantized; quantize the draft with --exclude lm_head"):
        LLM(str(checkpoints["llama"]), device="cpu", max_model_len=128, kv_cache_bytes=1 << 22, speculative_config=spec)


def test_gptq_writes_an_ordinary_checkpoint_of_its_format(checkpoints, tmp_path: Path) -> None:
    """--gptq (routed experts round to nearest): the loaded engine multiplies what the stored
    tensors dequantize to, generation equals the dequantized weights', the linear layers' roundings
    differ from round-to-nearest's, and a format without GPTQ rounding is refused."""
    directory = quantized(checkpoints, "qwen3_moe", "nvfp4", "--gptq")
    stored, nearest = on_disk_dequantized(directory, "nvfp4"), on_disk_dequantized(quantized(checkpoints, "qwen3_moe",
                                                                                             "nvfp4"), "nvfp4")
    model = LLM(str(directory), device="cpu", max_model_len=64, kv_cache_bytes=1 << 20).engine.runner.model
    attention = model.model.layers[0].self_attn.qkv_proj.dequantized_weight()
    assert torch.equal(attention, torch.cat([stored[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]))
    assert not torch.equal(stored["model.layers.0.self_attn.q_proj"], nearest["model.layers.0.self_attn.q_proj"])
    assert torch.equal(stored["model.layers.0.mlp.experts.0.down_proj"], nearest["model.layers.0.mlp.experts.0.down_proj"])
    original = load_file(str(checkpoints["qwen3_moe"] / "model.safetensors"))
    for module, weight in stored.items():
        assert (weight - original[f"{module}.weight"]).abs().max() <= original[f"{module}.weight"].abs().max() * 0.5, module
    assert greedy(directory) == greedy(dequantized_oracle(directory, "nvfp4", tmp_path / "oracle"))
    with pytest.raises(ConfigError, match="--gptq: the fp8 encoder has no GPTQ rounding; formats with one: nvfp4"):
        quantize_checkpoint(QuantizeRequest(str(checkpoints["llama"]), "fp8", tmp_path / "x", gptq=True))


def test_gptq_layer_by_layer_when_the_hessians_do_not_fit_at_once(checkpoints, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one layer's Hessians at a time, each layer's come from forwards through the
    layers before it already rounded (stopped after it): roundings differ from the one-pass
    checkpoint's past the first layer, and the checkpoint still generates as its dequantized weights."""
    import tokenmill.quantize.writer as writer

    one_pass = on_disk_dequantized(quantized(checkpoints, "llama", "nvfp4", "--gptq"), "nvfp4")
    monkeypatch.setattr(writer, "HESSIAN_BYTES", 1)
    forwards = []
    real = writer.calibrate
    monkeypatch.setattr(writer, "calibrate", lambda *a, **k: forwards.append(k.get("stop_after")) or real(*a, **k))
    directory = quantized(checkpoints, "llama", "nvfp4", "--gptq", "--calibration-tokens", "48")
    layered = on_disk_dequantized(directory, "nvfp4")
    assert len(forwards) == 1 + 2 and forwards[0] is None and all(f is not None for f in forwards[1:])
    assert all(torch.equal(layered[f"model.layers.0.{p}"], one_pass[f"model.layers.0.{p}"])
               for p in ("self_attn.q_proj", "mlp.down_proj"))
    assert not torch.equal(layered["model.layers.1.self_attn.q_proj"], one_pass["model.layers.1.self_attn.q_proj"])
    assert greedy(directory) == greedy(dequantized_oracle(directory, "nvfp4", tmp_path / "oracle"))

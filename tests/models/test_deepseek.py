"""DeepSeek-V2 / V3 against transformers (float32, CPU; bf16 on CUDA): logits of chunked prefill
(absorbed and up-projected chunks) and of every decode step, all-dense and with MoE layers (V2's
and V3's routing); V3's multi-token-prediction layers are skipped on load; the FP8 latent cache
takes its scale from the checkpoint or from calibration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_models import deepseek_config, save_deepseek_checkpoint
from parity import TARGETS, check_parity, rel_err, tolerance
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.kv.specs import LatentAttentionSpec
from tokenmill.layers.attention.mla import MLAAttention
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.moe import SparseMoeBlock
from tokenmill.models.deepseek import is_moe_layer
from tokenmill.numerics import FP8_E4M3_MAX
from tokenmill.quantization.kv_scales import CALIBRATION_TARGET
from tokenmill.runner.kv_calibration import calibration_token_ids, measure_kv_amax


def engine(path: Path, device: str = "cpu", dtype: str = "float32", **options: object) -> LLM:
    options = {"block_size": 4, "max_num_batched_tokens": 64, "kv_cache_bytes": 1 << 22, "max_model_len": 512,
               **options}
    return LLM(str(path), device=device, dtype=dtype, **options)


def random_prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# (config, prompt tokens, step budget): chunks of up to 17 tokens take the absorbed path.
DENSE_CASES = {"v2-300-up-projected-chunks": ("v2", 300, 64), "v2-23-tiny-chunks": ("v2", 23, 6), "v3-5": ("v3", 5, 64),
               "v3-150-absorbed-chunks": ("v3", 150, 13), "v3-neox-tied-37": ("v3-neox", 37, 16)}
MOE_CASES = {"v2-moe-grouped-softmax-100": ("v2-moe", 100, 32), "v3-moe-sigmoid-bias-60": ("v3-moe", 60, 16)}
# MoE models run in float32 on the CPU only, where parity is exact: in bf16 a tiny random router's
# top-k flips at near-ties (as for the Qwen MoE models); the MoE layer's GPU checks are its own.
CASES = [pytest.param(*case, *target.values, id=f"{name}-{target.id}", marks=target.marks)
         for name, case in DENSE_CASES.items() for target in TARGETS]
CASES += [pytest.param(*case, "cpu", "float32", id=f"{name}-cpu-fp32") for name, case in MOE_CASES.items()]


@pytest.mark.parametrize(("name", "length", "budget", "device", "dtype"), CASES)
def test_logits_match_transformers(name: str, length: int, budget: int, device: str, dtype: str,
                                   tmp_path: Path) -> None:
    """Chunks of up to 17 tokens take the absorbed path, longer ones the up-projection; decode
    steps the absorbed one."""
    hf_model = save_deepseek_checkpoint(deepseek_config(name), tmp_path)
    llm = engine(tmp_path, device, dtype, max_num_batched_tokens=budget)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == hf_model.config.num_hidden_layers
    assert all(isinstance(layer.cache_spec(), LatentAttentionSpec) for layer in layers)
    prompt = random_prompt(length)
    check_parity(llm, hf_model, prompt, steps=20, tol=tolerance(hf_model, prompt, dtype))


def test_moe_layers_follow_first_k_dense_replace_and_moe_layer_freq(tmp_path: Path) -> None:
    config = deepseek_config("v3-moe", num_hidden_layers=4)
    config.save_pretrained(tmp_path)
    model = LLM(str(tmp_path), device="cpu", load_format="dummy", kv_cache_bytes=1 << 22).engine.runner.model
    assert [type(layer.mlp) for layer in model.model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    routing = model.model.layers[1].mlp.routing
    assert (routing.scoring, routing.group_score, routing.has_correction_bias) == ("sigmoid", "top2_sum", True)
    assert (routing.n_group, routing.topk_group, routing.routed_scaling_factor) == (4, 2, 2.5)
    config.moe_layer_freq = 2  # DeepSeek's own code also skips every other layer
    assert [is_moe_layer(config, i) for i in range(4)] == [False, False, True, False]
    config.n_routed_experts = 0
    assert not any(is_moe_layer(config, i) for i in range(4))


def test_mtp_layers_are_skipped_and_stray_tensors_refused(tmp_path: Path) -> None:
    hf_model = save_deepseek_checkpoint(deepseek_config("v3"), tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    layers = hf_model.config.num_hidden_layers
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)  # V3's MTP layer
    tensors[f"model.layers.{layers}.self_attn.kv_b_proj.weight"] = torch.zeros(112, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    prompt = random_prompt(9)
    out = engine(tmp_path).generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, 9:].tolist()
    assert out.outputs[0].token_ids == expected
    tensors["model.layers.0.self_attn.stray.weight"] = torch.zeros(1)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="stray"):
        engine(tmp_path)


def fp8_logits_error(llm: LLM, hf_model: torch.nn.Module, prompt: list[int]) -> float:
    """Relative error of the engine's logits over a greedy continuation against transformers'."""
    seen: list[torch.Tensor] = []
    model = llm.engine.runner.model
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]  # type: ignore[method-assign]
    try:
        tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    finally:
        model.compute_logits = original  # type: ignore[method-assign]
    generated = tokens.outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    return rel_err(torch.cat(seen)[-len(generated):], ref)


def test_fp8_latent_cache_calibrated_or_from_the_checkpoint(tmp_path: Path) -> None:
    hf_model = save_deepseek_checkpoint(deepseek_config("v2"), tmp_path)
    prompt = random_prompt(40)
    llm = engine(tmp_path, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.scaled_cache_layers()
    assert len(layers) == 2 and all(isinstance(layer, MLAAttention) for layer in layers)
    assert all(layer.kv_cache.dtype == torch.float8_e4m3fn and layer.cache_spec().latent_dim == 40 for layer in layers)
    runner = llm.engine.runner
    ids, _ = calibration_token_ids(llm.engine.source, runner.vocab_size, 64)  # the engine calibrated on its budget
    calibrated = measure_kv_amax(runner.model, ids, runner.block_size, runner.dtype, runner.device)
    served = measure_kv_amax(runner.model, prompt, runner.block_size, runner.dtype, runner.device)
    for layer, (amax,), (served_amax,) in zip(layers, calibrated, served):
        assert amax / layer.cache_scale == pytest.approx(CALIBRATION_TARGET, rel=1e-5)
        assert FP8_E4M3_MAX / 16 < served_amax / layer.cache_scale <= FP8_E4M3_MAX
    # What the calibration records is what the layer stores: its normalised latent and rotated k_pe.
    first = runner.model.model.layers[0]
    with torch.no_grad():
        x = first.input_layernorm(runner.model.model.embed_tokens(torch.tensor(prompt)))
        _, _, latent, k_pe = first.self_attn.project(torch.arange(len(prompt)), x)
    assert served[0][0] == pytest.approx(torch.cat((latent, k_pe), -1).abs().amax().item(), rel=1e-6)
    assert fp8_logits_error(llm, hf_model, prompt) < 5e-2

    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.k_scale"] = torch.tensor(0.03)  # ModelOpt's MLA name
    tensors["model.layers.1.self_attn.mla_attn.k_scale"] = torch.tensor(0.02)  # vLLM's, with a v_scale
    tensors["model.layers.1.self_attn.mla_attn.v_scale"] = torch.tensor(0.05)
    save_file(tensors, file, metadata={"format": "pt"})
    given = engine(tmp_path, kv_cache_dtype="fp8").engine.runner.model.scaled_cache_layers()
    assert [layer.kv_scales for layer in given] == [(pytest.approx(0.03),), (pytest.approx(0.05),)]
    assert all(layer.kv_scales == (1.0,) for layer in engine(tmp_path).engine.runner.model.scaled_cache_layers())
    del tensors["model.layers.1.self_attn.mla_attn.k_scale"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="v_scale but no k_scale"):
        engine(tmp_path, kv_cache_dtype="fp8")

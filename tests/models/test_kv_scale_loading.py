"""FP8 KV-cache scales read from a checkpoint, under each name FP8 exporters give them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_checkpoint

from tokenmill.errors import ModelLoadError
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.models.interface import ModelBuild
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import iter_weights, load_hf_config, resolve_model
from tokenmill.models.registry import model_class

NUM_LAYERS = 2
K_SCALES = [0.03, 0.05]
V_SCALES = [0.007, 0.011]


def add_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add tensors to a saved single-file checkpoint, as an FP8 exporter would."""
    file = directory / "model.safetensors"
    save_file({**load_file(file), **tensors}, file, metadata={"format": "pt"})


def load(directory: Path) -> LlamaForCausalLM:
    source = resolve_model(str(directory))
    hf_config = load_hf_config(source)
    model = model_class(hf_config)(ModelBuild(hf_config, TorchReferenceBackend(), 64))
    model.load_weights(iter_weights(source))
    return model


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # ModelOpt: a 0-d tensor


def one(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32)  # compressed-tensors: shape [1]


def prefix(i: int) -> str:
    return f"model.layers.{i}.self_attn"


NAMINGS: dict[str, Callable[[int], dict[str, torch.Tensor]]] = {
    "compressed-tensors": lambda i: {f"{prefix(i)}.k_scale": one(K_SCALES[i]), f"{prefix(i)}.v_scale": one(V_SCALES[i])},
    "vllm attn": lambda i: {f"{prefix(i)}.attn.k_scale": scalar(K_SCALES[i]),
                            f"{prefix(i)}.attn.v_scale": scalar(V_SCALES[i])},
    "modelopt": lambda i: {f"{prefix(i)}.k_proj.k_scale": scalar(K_SCALES[i]),
                           f"{prefix(i)}.v_proj.v_scale": scalar(V_SCALES[i]),
                           f"{prefix(i)}.q_scale": scalar(1.0)},  # FP8 attention's query scale: not used
    "output_scale": lambda i: {f"{prefix(i)}.k_proj.output_scale": one(K_SCALES[i]),
                               f"{prefix(i)}.v_proj.output_scale": one(V_SCALES[i])},
    "bf16 per-head": lambda i: {f"{prefix(i)}.k_scale": torch.tensor([K_SCALES[i] / 2, K_SCALES[i]], dtype=torch.bfloat16),
                                f"{prefix(i)}.v_scale": torch.tensor([V_SCALES[i], V_SCALES[i] / 3], dtype=torch.bfloat16)},
}


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_checkpoint_kv_scales_land_on_each_layer(tmp_path: Path, naming: str) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    add_tensors(tmp_path, {k: v for i in range(NUM_LAYERS) for k, v in NAMINGS[naming](i).items()})
    layers = load(tmp_path).scaled_cache_layers()
    # bfloat16 keeps 8 bits of mantissa; a per-head scale becomes its largest head's.
    tolerance = 1e-2 if naming == "bf16 per-head" else 1e-7
    assert [a.checkpoint_kv_scales[0] for a in layers] == pytest.approx(K_SCALES, rel=tolerance)
    assert [a.checkpoint_kv_scales[1] for a in layers] == pytest.approx(V_SCALES, rel=tolerance)
    assert all(type(x) is float for a in layers for x in a.checkpoint_kv_scales)
    # Loading alone changes nothing: only a runner with an FP8 cache applies them (a draft model never).
    assert all(a.k_scale == a.v_scale == 1.0 for a in layers)


def test_legacy_kv_scale_sets_both(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    add_tensors(tmp_path, {f"{prefix(i)}.kv_scale": scalar(K_SCALES[i]) for i in range(NUM_LAYERS)})
    layers = load(tmp_path).scaled_cache_layers()
    assert [x for a in layers for x in a.checkpoint_kv_scales] == pytest.approx([k for k in K_SCALES for _ in "kv"])


def test_checkpoint_without_scales_keeps_one(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    layers = load(tmp_path).scaled_cache_layers()
    assert all(a.k_scale == a.v_scale == 1.0 and a.checkpoint_kv_scales is None for a in layers)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_unusable_scale_is_refused(tmp_path: Path, bad: float) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    add_tensors(tmp_path, {f"{prefix(0)}.k_scale": scalar(bad), f"{prefix(0)}.v_scale": scalar(0.1)})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.k_scale: KV scale .* must be finite and positive"):
        load(tmp_path)


def test_k_scale_without_v_scale_is_refused(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    add_tensors(tmp_path, {f"{prefix(1)}.k_scale": scalar(0.1)})
    with pytest.raises(ModelLoadError, match="layers.1.self_attn: .* k_scale but no v_scale"):
        load(tmp_path)


def test_scales_of_a_layer_the_model_lacks_are_refused(tmp_path: Path) -> None:
    save_tiny_checkpoint("llama", tmp_path)
    add_tensors(tmp_path, {f"{prefix(7)}.k_scale": scalar(0.1), f"{prefix(7)}.v_scale": scalar(0.1)})
    with pytest.raises(ModelLoadError, match="layers.7.self_attn"):
        load(tmp_path)

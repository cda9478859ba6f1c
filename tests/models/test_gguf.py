"""GGUF checkpoints written here the way llama.cpp's convert_hf_to_gguf writes them."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.errors import ModelLoadError
from tokenmill.models.gguf_config import llama3_rope_from_factors
from tokenmill.models.gguf_file import unpermute_rotary
from tokenmill.models.loader import iter_weights, load_hf_config, load_tokenizer, resolve_model

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
# Largest |error| of quantize+dequantize relative to the tensor's max |value| (one step of the grid).
QUANT_REL_ERROR = {Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31}


def tiny(kind: str, tied: bool = False, rope: dict | None = None, bias: bool = False) -> PreTrainedModel:
    torch.manual_seed(0)
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "llama":
        config = LlamaConfig(**SMALL, head_dim=16, tie_word_embeddings=tied, rope_parameters=rope,
                             attention_bias=bias)
        return LlamaForCausalLM(config)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied, rope_parameters=rope))
    config = Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=tied, rope_parameters=rope)
    return Qwen3ForCausalLM(config)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config: LlamaConfig) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.generate_extra_tensors (rope_freqs for llama3 rope)."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], 8192
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def encode(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(path: Path, model: PreTrainedModel, qtype: Q, name: str = "tiny") -> dict[str, np.ndarray]:
    """Write `model` as GGUF; return what each GGUF tensor decodes to, in HF names and order."""
    cfg = model.config
    kind = cfg.model_type
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCH[kind]])
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if kind != "qwen2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if kind == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(ARCH[kind], cfg.num_hidden_layers)
    decoded: dict[str, np.ndarray] = {}
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    for hf_name, tensor in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        w = tensor.float().numpy()
        if kind == "llama" and ".q_proj." in hf_name:
            w = permute(w, cfg.num_attention_heads)
        elif kind == "llama" and ".k_proj." in hf_name:
            w = permute(w, cfg.num_key_value_heads)
        data, raw = encode(w, qtype if w.ndim == 2 else Q.F32)
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
        decoded[hf_name] = gguf.quants.dequantize(data, raw or (Q.F16 if data.dtype == np.float16 else Q.F32))
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def unpermuted(decoded: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, w in decoded.items():
        t = torch.from_numpy(np.ascontiguousarray(w))
        if cfg.model_type == "llama" and ".q_proj." in name:
            t = unpermute_rotary(t, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and ".k_proj." in name:
            t = unpermute_rotary(t, cfg.num_key_value_heads)
        out[name] = t
    return out


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):  # head_dim >= 4: a head of one pair is its own permutation
        p = permute(w, heads)
        assert not np.array_equal(p, w)
        assert torch.equal(unpermute_rotary(torch.from_numpy(p.copy()), heads), torch.from_numpy(w))
    bias = np.arange(8, dtype=np.float32)
    assert torch.equal(unpermute_rotary(torch.from_numpy(permute(bias, 2).copy()), 2), torch.from_numpy(bias))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda q: q.name)
def test_float_gguf_is_exact(tmp_path: Path, kind: str, qtype: Q) -> None:
    model = tiny(kind, tied=(kind == "qwen3"), bias=(kind == "llama"))
    write_gguf(tmp_path / "m.gguf", model, qtype)
    got = dict(iter_weights(resolve_model(tmp_path / "m.gguf")))
    want = model.state_dict()
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        expected = tensor if qtype == Q.F32 or tensor.ndim == 1 else tensor.half()
        assert got[name].dtype == expected.dtype, name
        assert torch.equal(got[name], expected), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16], ids=lambda q: q.name)
def test_quantized_llama_gguf(tmp_path: Path, qtype: Q) -> None:
    model = tiny("llama")
    decoded = write_gguf(tmp_path / "m.gguf", model, qtype)
    got = dict(iter_weights(resolve_model(tmp_path)))
    reference = unpermuted(decoded, model.config)
    for name, tensor in model.state_dict().items():
        if qtype == Q.BF16 and tensor.ndim == 2:
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], tensor.bfloat16()), name
            continue
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], reference[name]), name  # bit-exact gguf dequantization
        bound = QUANT_REL_ERROR.get(qtype, 0.0) * 1.01 * tensor.abs().max().item()
        assert (got[name] - tensor).abs().max().item() <= bound, name  # and close to the original


def test_gguf_config_round_trip(tmp_path: Path) -> None:
    for kind in ("llama", "qwen2", "qwen3"):
        for tied in (True, False):
            model = tiny(kind, tied=tied)
            path = tmp_path / f"{kind}-{tied}.gguf"
            write_gguf(path, model, Q.F16)
            config = load_hf_config(resolve_model(path))
            want = model.config
            assert type(config) is type(want)
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "vocab_size", "max_position_embeddings",
                        "tie_word_embeddings", "bos_token_id", "eos_token_id"):
                assert getattr(config, key) == getattr(want, key), (kind, key)
            assert config.head_dim == (getattr(want, "head_dim", None) or 16)
            assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
            assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
            assert config.dtype == torch.float16


@pytest.mark.parametrize(
    ("theta", "factor", "lo", "hi"),
    [(500000.0, 8.0, 1.0, 4.0), (500000.0, 32.0, 2.0, 16.0), (10000.0, 4.0, 1.0, 4.0), (500000.0, 8.0, 3.0, 5.0)],
)
def test_llama3_rope_recovered_from_rope_freqs(tmp_path: Path, theta: float, factor: float, lo: float,
                                               hi: float) -> None:
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": lo,
            "high_freq_factor": hi, "original_max_position_embeddings": 8192}
    model = tiny("llama", rope=rope)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, Q.F32)
    config = load_hf_config(resolve_model(path))
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == factor
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    ours, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in dict(iter_weights(resolve_model(path)))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("factor", "lo", "hi"), [(8.0, 1.0, 4.0), (32.0, 1.0, 32.0), (16.0, 2.0, 3.0)])
def test_llama3_rope_from_factors(head_dim: int, factor: float, lo: float, hi: float) -> None:
    config = LlamaConfig(**{**SMALL, "hidden_size": head_dim * 4}, head_dim=head_dim, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": lo,
        "high_freq_factor": hi, "original_max_position_embeddings": 8192})
    params = llama3_rope_from_factors(llama3_rope_freqs(config).astype(np.float64), 500000.0, head_dim, "x")
    ours = LlamaConfig(**{**SMALL, "hidden_size": head_dim * 4}, head_dim=head_dim, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got, _ = ROPE_INIT_FUNCTIONS["llama3"](ours, "cpu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_rope_freqs_off_the_llama3_formula_is_refused() -> None:
    factors = np.linspace(1.0, 8.0, 32) ** 1.5
    with pytest.raises(ModelLoadError, match="does not follow the llama3 rope formula"):
        llama3_rope_from_factors(factors, 500000.0, 64, "m.gguf")


# --- bad GGUF input

def _minimal_gguf(path: Path, arch: str = "llama", tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_head_count(2)
    for name, (data, raw) in (tensors or {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    source = resolve_model(path)
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a readable GGUF file"):
        load_hf_config(source)
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a readable GGUF file"):
        list(iter_weights(source))


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "cut.gguf"
    write_gguf(path, tiny("llama"), Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF file"):
        list(iter_weights(resolve_model(path)))


def test_unsupported_arch_lists_supported(tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported.*llama, qwen2, qwen3"):
        load_hf_config(resolve_model(path))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        list(iter_weights(resolve_model(path)))


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    raw = np.zeros((8, 84), np.uint8)  # 8 rows of one Q2_K block (256 values, 84 bytes)
    path = _minimal_gguf(tmp_path / "q2.gguf", tensors={"token_embd.weight": (raw, Q.Q2_K)})
    with pytest.raises(ModelLoadError, match="'token_embd.weight' uses GGML type Q2_K.*Supported types: .*Q4_K"):
        list(iter_weights(resolve_model(path)))


def test_unknown_tensor_name_is_refused(tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / "u.gguf", tensors={
        "token_embd.weight": (np.zeros((8, 32), np.float32), None),
        "blk.0.attn_mystery.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(ModelLoadError, match="blk.0.attn_mystery.weight"):
        list(iter_weights(resolve_model(path)))


def test_gguf_without_vocab_has_no_tokenizer(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", tiny("qwen3"), Q.F32)
    assert load_tokenizer(resolve_model(tmp_path)) is None


def test_mistral_named_llama_gguf_gets_mistral_config(tmp_path: Path) -> None:
    model = tiny("llama")
    write_gguf(tmp_path / "m.gguf", model, Q.F32, name="Mistral 7B Instruct v0.3")
    config = load_hf_config(resolve_model(tmp_path))
    assert config.model_type == "mistral"
    assert config.sliding_window is None
    got = dict(iter_weights(resolve_model(tmp_path)))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(got[name], model.state_dict()[name])


def test_incomplete_or_non_uniform_metadata(tmp_path: Path) -> None:
    path = _minimal_gguf(tmp_path / "a.gguf")  # no embedding_length
    with pytest.raises(ModelLoadError, match="lacks 'llama.embedding_length'.*incomplete"):
        load_hf_config(resolve_model(path))
    writer = gguf.GGUFWriter(tmp_path / "b.gguf", "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv([2, 1])
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'llama.attention.head_count_kv' varies per layer"):
        load_hf_config(resolve_model(tmp_path / "b.gguf"))

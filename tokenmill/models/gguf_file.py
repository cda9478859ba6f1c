"""Reading GGUF checkpoints: metadata, tensor names, dequantization and llama.cpp's Q/K permutation."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenmill.errors import ModelLoadError
from tokenmill.models.gguf_dequant import FAST_DEQUANTIZERS
from tokenmill.models.gguf_header import GGUFTensor, read_gguf_header

# GGUF architecture names; see gguf_config.py for the transformers configs they become.
SUPPORTED_GGUF_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")

_Q = GGMLQuantizationType
# Dequantized with gguf.quants; each type here is covered by tests/models.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q4_K, _Q.Q6_K}
)

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts [E, rows, cols]: yielded per expert under the names save_pretrained writes.
_EXPERT_NAMES: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no HF parameter: llama3 rope factors are folded into the config instead.
_NON_PARAMETER_TENSORS: frozenset[str] = frozenset({"rope_freqs.weight"})


def hf_param_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None when it has none. Stacked experts
    name every expert's tensor: `...mlp.experts.{}.gate_proj.weight`, `{}` for the expert index."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    block, kind, suffix = m.groups()
    if kind in _EXPERT_NAMES:
        return f"model.layers.{block}.mlp.experts.{{}}.{_EXPERT_NAMES[kind]}.{suffix}"
    if kind not in _BLOCK_NAMES:
        return None
    return f"model.layers.{block}.{_BLOCK_NAMES[kind]}.{suffix}"


class GGUFCheckpoint:
    """One opened GGUF file: typed metadata access and tensors by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            header = read_gguf_header(path)
        except Exception as e:  # ValueError, struct.error, UnicodeDecodeError, ... on bad bytes
            raise ModelLoadError(
                f"{path}: not a readable GGUF file ({type(e).__name__}: {e}). "
                "The file is truncated, corrupt or not GGUF; download it again or pass another model."
            ) from e
        self.fields: dict[str, Any] = header.fields
        self.tensors: dict[str, GGUFTensor] = header.tensors
        self.arch: str = self.get_str("general.architecture") or ""

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def get_str(self, key: str, default: str | None = None) -> str | None:
        value = self.get(key, default)
        return value if value is None or isinstance(value, str) else str(value)

    def arch_key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def get_int(self, suffix: str, default: int | None = None) -> int | None:
        """An integer `<arch>.<suffix>` key; a per-layer list must hold one value."""
        key = self.arch_key(suffix)
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ModelLoadError(
                    f"{self.path}: {key!r} varies per layer ({value}); tokenmill supports only "
                    "uniform layers for this architecture"
                )
            value = value[0]
        return int(self._number(key, value))

    def require_int(self, suffix: str) -> int:
        value = self.get_int(suffix)
        if value is None:
            raise ModelLoadError(
                f"{self.path}: GGUF metadata lacks {self.arch_key(suffix)!r}; the file is incomplete"
            )
        return value

    def get_float(self, suffix: str, default: float | None = None) -> float | None:
        key = self.arch_key(suffix)
        value = self.get(key)
        return default if value is None else self._number(key, value)

    def _number(self, key: str, value: Any) -> float:
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            return float(value) if isinstance(value, (float, np.floating)) else int(value)
        raise ModelLoadError(f"{self.path}: metadata key {key!r} should be a number, not {value!r}")

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in PyTorch order ([out, in] for a linear weight)."""
        return tuple(reversed([int(d) for d in self.tensors[name].shape]))

    def tensor_types(self) -> set[GGMLQuantizationType]:
        return {t.tensor_type for t in self.tensors.values()}

    def read_tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32; F32, F16 and BF16 keep their stored dtype."""
        t = self.tensors[name]
        qtype = t.tensor_type
        if qtype not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} uses GGML type {qtype.name}, which tokenmill cannot "
                f"dequantize. Supported types: {supported}. Use a GGUF with one of those "
                "(e.g. Q4_K_M, Q8_0 or F16)."
            )
        shape = self.tensor_shape(name)
        try:
            if qtype == _Q.BF16:
                raw = np.array(t.data, copy=True).view(np.int16).reshape(shape)
                return torch.from_numpy(raw).view(torch.bfloat16)
            if qtype in (_Q.F32, _Q.F16):
                return torch.from_numpy(np.array(t.data, copy=True).reshape(shape))
            fast = FAST_DEQUANTIZERS.get(qtype)
            if fast is not None:
                return fast(t.data).reshape(shape)
            return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, qtype)).reshape(shape))
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: cannot decode tensor {name!r} ({qtype.name}, shape {shape}): {e}"
            ) from e


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Open a GGUF file; the parsed header is cached (the config, the tokenizer and the weights all read it)."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e})") from e
    return _open_cached(path.resolve(), st.st_size, st.st_mtime_ns)


def unpermute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute on a q/k weight or bias.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3), ...; HF rotates the two halves of
    each head. The converter reorders each head's rows from [half0 | half1] to interleaved.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelLoadError(f"cannot un-permute a q/k tensor of {rows} rows into {n_head} heads")
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(ckpt: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every parameter tensor of a GGUF checkpoint."""
    if ckpt.arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"{ckpt.path}: GGUF architecture {ckpt.arch!r} is not supported; "
            f"tokenmill reads GGUF files of: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    unknown = [n for n in ckpt.tensors if n not in _NON_PARAMETER_TENSORS and hf_param_name(n) is None]
    if unknown:
        raise ModelLoadError(
            f"{ckpt.path}: tensors with no known Hugging Face name for architecture {ckpt.arch!r}: "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    n_head = ckpt.require_int("attention.head_count")
    n_kv_head = ckpt.get_int("attention.head_count_kv") or n_head
    for name in ckpt.tensors:
        hf_name = hf_param_name(name)
        if hf_name is None:
            continue
        tensor = ckpt.read_tensor(name)
        # convert_hf_to_gguf permutes q/k only for LlamaModel (llama, mistral); the Qwen families keep HF order.
        if ckpt.arch == "llama":
            if ".attn_q." in name:
                tensor = unpermute_rotary(tensor, n_head)
            elif ".attn_k." in name:
                tensor = unpermute_rotary(tensor, n_kv_head)
        if "{}" in hf_name:
            for expert, weight in enumerate(tensor.unbind(0)):
                yield hf_name.format(expert), weight
        elif ".ffn_gate_inp_shexp." in name and tensor.dim() == 1:
            yield hf_name, tensor[None]  # llama.cpp keeps Qwen2-MoE's shared-expert gate [1, H] as [H]
        else:
            yield hf_name, tensor

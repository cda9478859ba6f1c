"""Dual weights (`--dual-weights nvfp4+fp8 | nvfp4+mxfp8`): two copies of each quantized layer, the
step's number of tokens picking one. A step of fewer than `threshold` tokens (decode, verify)
reads the NVFP4 copy, the fewest bytes; a bigger one (prefill) multiplies the second copy, FP8
with one scale per row (W8A8 on Hopper's FP8 tensor cores) or MXFP8. The token count of a step is
static per CUDA-graph bucket, so graphs capture one copy each.

Where the copies come from:
- An NVFP4 checkpoint: the first copy is the checkpoint's own layer; the second is its
  dequantized NVFP4 weight quantized again at load. It carries NVFP4's error plus the second
  rounding (FP8 rows or MXFP8 of values that are not on their grid): prefill is not more accurate
  than decode, only faster.
- A high-precision checkpoint: both copies are quantized at load from its weights (NVFP4 with one
  global scale per shard, weight-only, so no calibration), each as accurate as its format allows.

The second copy lives in a child module of the layer (`second_copy`, a `CopyLayer` or
`CopyExperts`), its parameters named and sized by its own method. `extra_weight_bytes` gives
start-up the bytes the copy adds, so the model is sized with both before it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.numerics import FP8_E4M3_MAX, quantize_e4m3
from tokenmill.quantization.base import (
    ExpertsLayer,
    FusedMoEMethod,
    LinearLayer,
    LinearMethod,
    QuantizationConfig,
    Shard,
)
from tokenmill.quantization.checkpoint import ROUTERS, CheckpointQuantization, excluded
from tokenmill.quantization.mxfp8 import MxFp8Config, MxFp8Encoder
from tokenmill.quantization.nvfp4 import W4A16, Nvfp4LinearMethod
from tokenmill.quantization.nvfp4_checkpoint import Nvfp4Config, Nvfp4Encoder
from tokenmill.quantization.nvfp4_experts import Nvfp4FusedMoEMethod
from tokenmill.quantization.scaled_fp8 import ScaledFp8LinearMethod, ScaleLayout
from tokenmill.quantization.scaled_fp8_experts import ScaledFp8FusedMoEMethod
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.quantization.unquantized_experts import UnquantizedFusedMoEMethod

KEEP = ("lm_head", *ROUTERS)
"""Layers of a high-precision checkpoint that keep one copy, unquantized: the head and the MoE routers."""

Encode = Callable[[torch.Tensor], dict[str, torch.Tensor]]
NO_CALIBRATION = {"input_amax": torch.tensor(0.0)}


def fp8_rows_encode(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """FP8 E4M3 with one float32 scale per row (row amax / 448)."""
    amax = weight.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return {"weight": quantize_e4m3(weight, scale[:, None]), "weight_scale": scale}


@dataclass(frozen=True)
class CopyFormat:
    """How one copy is made (`encode`: a float32 weight [rows, K] -> its tensors by suffix) and the
    methods that hold and multiply it."""

    name: str
    column_group: int
    encode: Encode
    linear: Callable[[str, bool], LinearMethod]
    experts: Callable[[str, bool], FusedMoEMethod]


FP8_ROWS = ScaleLayout("weight_scale", (1, 0), torch.float32, "w8a8-rows")
SECOND_COPIES = {
    "fp8": CopyFormat("fp8 rows", 1, fp8_rows_encode, lambda p, t: ScaledFp8LinearMethod(FP8_ROWS, p, t),
                      lambda p, t: ScaledFp8FusedMoEMethod(FP8_ROWS, p, t)),
    "mxfp8": CopyFormat("mxfp8", 32, lambda w: MxFp8Encoder().encode("", w, NO_CALIBRATION),
                        lambda p, t: MxFp8Config.from_settings({"quant_algo": "MXFP8"}, t).linear_method(p),
                        lambda p, t: MxFp8Config.from_settings({"quant_algo": "MXFP8"}, t).experts_method(p)),
}
NVFP4_COPY = CopyFormat("nvfp4", 16, lambda w: Nvfp4Encoder().encode("", w, NO_CALIBRATION),
                        lambda p, t: Nvfp4LinearMethod(p, W4A16, input_scales=False, use_triton=t),
                        lambda p, t: Nvfp4FusedMoEMethod(p, input_scales=False, use_triton=t))


class CopyLayer(nn.Module):
    """The linear layer a copy's method sees: the layer's shapes and its bias (not registered
    twice), the copy's own parameters."""

    def __init__(self, layer: LinearLayer) -> None:
        super().__init__()
        self.in_features, self.out_features, self.output_sizes = layer.in_features, layer.out_features, layer.output_sizes
        self.__dict__["bias"] = layer.bias

    @property
    def shards(self) -> list[int] | None:
        return list(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else None


class CopyExperts(nn.Module):
    def __init__(self, layer: ExpertsLayer) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = (layer.num_experts, layer.hidden_size,
                                                                      layer.intermediate_size)


def load_encoded(target: nn.Module, encoded: dict[str, torch.Tensor], shard: Shard, prefix: str = "") -> None:
    """Load one shard's encoded tensors into `target`'s parameters (`prefix` + suffix) by their loaders."""
    for suffix, tensor in encoded.items():
        param = getattr(target, prefix + suffix, None)
        if param is not None:  # tensors a method does not keep (input scales of weight-only copies)
            param.weight_loader(param, tensor.to(param.device), shard)


def param_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class DualLinearMethod(LinearMethod):
    """`first` holds the layer's copy for steps of fewer than `threshold` tokens (the checkpoint's
    NVFP4 method, or for a high-precision checkpoint an unquantized weight quantized to NVFP4 at
    load), `second` the copy for bigger steps."""

    def __init__(self, first: LinearMethod, second: CopyFormat, threshold: int, prefix: str, use_triton: bool) -> None:
        self.first = first
        self.from_high_precision = not isinstance(first, Nvfp4LinearMethod)
        self.second_format = second
        self.second = second.linear(prefix, use_triton)
        self.threshold = threshold
        self.prefix = prefix
        self.use_triton = use_triton
        self.processed = False
        self.name = f"dual (nvfp4 below {threshold} tokens, else {second.name})"

    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        for fmt in (NVFP4_COPY, self.second_format):
            if layer.in_features % fmt.column_group:
                raise ConfigError(f"{self.prefix}: {layer.in_features} input columns are not a multiple of the "
                                  f"{fmt.column_group}-column groups of its {fmt.name} copy; use another --dual-weights "
                                  "or none")
        self.first.create_weights(layer, dtype, device)

    def extra_weight_bytes(self, layer: LinearLayer) -> int:
        second = CopyLayer(layer)
        self.second.create_weights(second, torch.float32, "meta")
        if not self.from_high_precision:
            return param_bytes(second)
        first = CopyLayer(layer)
        NVFP4_COPY.linear(self.prefix, False).create_weights(first, torch.float32, "meta")
        return max(0, param_bytes(first) + param_bytes(second) - layer.weight.numel() * layer.weight.element_size())

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        if self.processed:
            return
        self.first.process_weights_after_loading(layer)
        weight = self.first.dequantized_weight(layer)
        if self.from_high_precision:
            self.first = NVFP4_COPY.linear(self.prefix, self.use_triton)
            self.first.create_weights(layer, weight.dtype, weight.device)
            self._encode_into(layer, self.first, NVFP4_COPY.encode, weight)
        second = CopyLayer(layer)
        self.second.create_weights(second, weight.dtype, weight.device)
        self._encode_into(second, self.second, self.second_format.encode, weight)
        layer.register_module("second_copy", second)  # type: ignore[attr-defined]
        self.processed = True

    @staticmethod
    def _encode_into(target: nn.Module, method: LinearMethod, encode: Encode, weight: torch.Tensor) -> None:
        sizes = target.output_sizes
        start = 0
        for i, rows in enumerate(sizes):
            load_encoded(target, encode(weight[start: start + rows]), i if len(sizes) > 1 else None)
            start += rows
        method.process_weights_after_loading(target)  # type: ignore[arg-type]

    def uses_second(self, x: torch.Tensor) -> bool:
        return self.processed and x.numel() >= self.threshold * x.shape[-1]

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if self.uses_second(x):
            return self.second.apply(layer.second_copy, x)  # type: ignore[attr-defined]
        return self.first.apply(layer, x)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return self.first.dequantized_weight(layer)


class DualFusedMoEMethod(FusedMoEMethod):
    """Dual weights of a MoE layer's routed experts (as DualLinearMethod)."""

    def __init__(self, first: FusedMoEMethod, second: CopyFormat, threshold: int, prefix: str, use_triton: bool) -> None:
        self.first = first
        self.from_high_precision = not isinstance(first, Nvfp4FusedMoEMethod)
        self.second_format = second
        self.second = second.experts(prefix, use_triton)
        self.threshold = threshold
        self.prefix = prefix
        self.use_triton = use_triton
        self.processed = False
        self.name = f"dual experts (nvfp4 below {threshold} tokens, else {second.name})"

    def create_weights(self, layer: ExpertsLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        for fmt in (NVFP4_COPY, self.second_format):
            for cols in (layer.hidden_size, layer.intermediate_size):
                if cols % fmt.column_group:
                    raise ConfigError(f"{self.prefix}: {cols} input columns are not a multiple of the "
                                      f"{fmt.column_group}-column groups of its {fmt.name} copy; use another "
                                      "--dual-weights or none")
        self.first.create_weights(layer, dtype, device)

    def extra_weight_bytes(self, layer: ExpertsLayer) -> int:
        second = CopyExperts(layer)
        self.second.create_weights(second, torch.float32, "meta")
        if not self.from_high_precision:
            return param_bytes(second)
        first = CopyExperts(layer)
        NVFP4_COPY.experts(self.prefix, False).create_weights(first, torch.float32, "meta")
        stacked = sum(t.numel() * t.element_size() for t in (layer.w13, layer.w2))  # type: ignore[attr-defined]
        return max(0, param_bytes(first) + param_bytes(second) - stacked)

    def process_weights_after_loading(self, layer: ExpertsLayer) -> None:
        if self.processed:
            return
        self.first.process_weights_after_loading(layer)
        w13, w2 = self.first.dequantized_weights(layer)
        if self.from_high_precision:
            self.first = NVFP4_COPY.experts(self.prefix, self.use_triton)
            self.first.create_weights(layer, w13.dtype, w13.device)
            self._encode_into(layer, self.first, NVFP4_COPY.encode, w13, w2)
        second = CopyExperts(layer)
        self.second.create_weights(second, w13.dtype, w13.device)
        self._encode_into(second, self.second, self.second_format.encode, w13, w2)
        layer.register_module("second_copy", second)  # type: ignore[attr-defined]
        self.processed = True

    @staticmethod
    def _encode_into(target: nn.Module, method: FusedMoEMethod, encode: Encode, w13: torch.Tensor,
                     w2: torch.Tensor) -> None:
        inter = w13.shape[1] // 2
        for expert in range(w13.shape[0]):
            for projection, weight, stack in (("gate", w13[expert, :inter], "w13"), ("up", w13[expert, inter:], "w13"),
                                              ("down", w2[expert], "w2")):
                encoded = encode(weight)
                load_encoded(target, {"": encoded.pop("weight")}, (expert, projection), stack)
                load_encoded(target, encoded, (expert, projection), f"{stack}_")
        method.process_weights_after_loading(target)  # type: ignore[arg-type]

    def apply(
        self, layer: ExpertsLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.processed and x.shape[0] >= self.threshold:
            return self.second.apply(layer.second_copy, x, topk_weights, topk_ids, addend, addend_gate)  # type: ignore[attr-defined]
        return self.first.apply(layer, x, topk_weights, topk_ids, addend, addend_gate)

    def dequantized_weights(self, layer: ExpertsLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first.dequantized_weights(layer)


class DualWeights(QuantizationConfig):
    """The checkpoint's quantization (None: high precision) with dual weights for its NVFP4 layers,
    or for every linear layer and expert of a high-precision checkpoint but the head and routers."""

    def __init__(self, base: QuantizationConfig | None, second: str, threshold: int, use_triton: bool = False) -> None:
        if base is not None and not (isinstance(base, CheckpointQuantization)
                                     and any(isinstance(f, Nvfp4Config) for f in base.formats)):
            raise ConfigError(f"--dual-weights keeps an NVFP4 copy beside a second one, made from an NVFP4 or a "
                              f"high-precision checkpoint; this one is {base.name}: drop --dual-weights")
        self.base = base
        self.second = SECOND_COPIES[second]
        self.threshold = threshold
        self.use_triton = use_triton
        self.name = f"dual weights: nvfp4 + {second} from {base.name if base else 'high precision'}"

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.base is None:
            if excluded(prefix, KEEP):
                return UnquantizedLinearMethod(self.use_triton)
            return DualLinearMethod(UnquantizedLinearMethod(self.use_triton), self.second, self.threshold, prefix,
                                    self.use_triton)
        method = self.base.linear_method(prefix)
        if not isinstance(method, Nvfp4LinearMethod):
            return method
        return DualLinearMethod(method, self.second, self.threshold, prefix, self.use_triton)

    def experts_method(self, prefix: str) -> FusedMoEMethod:
        method = self.base.experts_method(prefix) if self.base is not None else UnquantizedFusedMoEMethod(self.use_triton)
        if self.base is not None and not isinstance(method, Nvfp4FusedMoEMethod):
            return method
        return DualFusedMoEMethod(method, self.second, self.threshold, prefix, self.use_triton)

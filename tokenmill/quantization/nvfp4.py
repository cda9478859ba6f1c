"""NVFP4 weights: the linear method of NVFP4 checkpoints (quantization/nvfp4_checkpoint.py has
the format, nvfp4_experts.py the routed experts).

Per linear layer: `weight` uint8 [N, K / 2] (E2M1, element 2i in the low nibble), `weight_scale`
float8_e4m3fn [N, K / 16] and `weight_scale_2` float32 [N]: the real weight is
`numerics.dequantize_nvfp4(weight, weight_scale, weight_scale_2[:, None])`. Fused projections
(q/k/v, gate/up) stay exact whatever their shards' global scales: each shard's per-tensor
weight_scale_2 is kept for each of its output rows, multiplying the row's sum. Input scales
(NVFP4, not W4A16_NVFP4) load per shard; W4A4 quantizes the one shared input under the largest
(ModelOpt calibrates them on the same input, so they agree).

W4A16 keeps activations in the model dtype and decodes the weight in the kernel
(kernels/nvfp4.py; Hopper has no FP4 MMA). W4A4 quantizes them per 16 under input_scale first,
the numerics of Blackwell's FP4 MMA. On the CPU the reference dequantizes the weight a slab of
rows at a time and multiplies by torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.numerics import NVFP4_GROUP, dequantize_nvfp4, quantize_nvfp4
from tokenmill.quantization.base import LinearLayer, LinearMethod, set_weight_loader
from tokenmill.quantization.scaled_fp8 import DEQUANT_ROWS, register_input_scale
from tokenmill.quantization.weight_loading import Fit, output_rows_loader

W4A4, W4A16 = "w4a4", "w4a16"


def per_tensor_fit(tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """A per-tensor global scale spread over its shard's rows (a stacked or per-row one as it is)."""
    if tensor.numel() == 1:
        return tensor.float().reshape(()).expand(dest.shape)
    if tensor.numel() != dest.numel():
        raise ModelLoadError(f"weight_scale_2 of {tensor.numel()} values where one per tensor is read")
    return tensor.float().reshape(dest.shape)


def check_group_columns(prefix: str, k: int) -> None:
    if k % NVFP4_GROUP:
        raise ConfigError(f"{prefix}: {k} input columns are not a multiple of NVFP4's {NVFP4_GROUP}-column scale "
                          "groups; keep this layer unquantized (exclude it) when quantizing")


class Nvfp4LinearMethod(LinearMethod):
    def __init__(self, prefix: str, activations: str = W4A16, input_scales: bool = True, use_triton: bool = False) -> None:
        self.prefix = prefix
        self.activations = activations
        self.input_scales = input_scales
        self.use_triton = use_triton
        self.name = f"nvfp4 {activations}"

    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        sizes, k, n = layer.output_sizes, layer.in_features, layer.out_features
        check_group_columns(self.prefix, k)
        tensors: dict[str, tuple[torch.Tensor, Fit | None]] = {
            "weight": (torch.zeros(n, k // 2, dtype=torch.uint8, device=device), None),
            "weight_scale": (torch.ones(n, k // NVFP4_GROUP, device=device).to(torch.float8_e4m3fn), None),
            "weight_scale_2": (torch.ones(n, dtype=torch.float32, device=device), per_tensor_fit),
        }
        for name, (tensor, fit) in tensors.items():
            param = set_weight_loader(nn.Parameter(tensor, requires_grad=False), output_rows_loader(sizes, fit),
                                      shards=layer.shards)
            layer.register_parameter(name, param)
        if self.input_scales:
            register_input_scale(layer, len(sizes), device)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        weight, scale, rows = layer.weight, layer.weight_scale, layer.weight_scale_2  # type: ignore[attr-defined]
        if self.use_triton and x.dim() == 2 and x.is_contiguous():
            from tokenmill.kernels.nvfp4 import nvfp4_linear, nvfp4_w4a4_linear

            if self.activations == W4A4:
                return nvfp4_w4a4_linear(x, layer.input_scale.max(), weight, scale, rows, layer.bias)  # type: ignore[attr-defined]
            return nvfp4_linear(x, weight, scale, rows, layer.bias)
        if self.activations == W4A4:
            x = fake_quantized_input(x, layer.input_scale.max())  # type: ignore[attr-defined]
        return dequantized_nvfp4_linear(x, weight, scale, rows, layer.bias)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return dequantize_nvfp4(layer.weight, layer.weight_scale, layer.weight_scale_2[:, None])  # type: ignore[attr-defined]


def fake_quantized_input(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x as W4A4 sees it: quantized to NVFP4 per 16 under input_scale, dequantized (float32 math)."""
    flat = x.reshape(-1, x.shape[-1])
    packed, scale = quantize_nvfp4(flat, input_scale.float())
    return dequantize_nvfp4(packed, scale, input_scale.float()).reshape(x.shape).to(x.dtype)


def dequantized_nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) with W dequantized DEQUANT_ROWS rows at a time, in x's dtype."""
    n = weight.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, DEQUANT_ROWS):
        part = slice(start, start + DEQUANT_ROWS)
        w = dequantize_nvfp4(weight[part], scale[part], rows[part, None]).to(x.dtype)
        out[..., part] = F.linear(x, w, None if bias is None else bias[part])
    return out



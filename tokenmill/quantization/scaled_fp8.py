"""FP8 E4M3 weights with block scales: the linear method of every FP8-element checkpoint format.

A format is a `ScaleLayout`: which checkpoint tensor holds the scales, how many weight rows and
columns share one (per tensor or per row: (1, 0), a whole row; DeepSeek blocks: (128, 128); MX:
(1, 32) with E8M0 codes), and how prefill multiplies. The real weight is
`numerics.dequantize_blocks(weight, scale, block)`.

Fused projections (q/k/v, gate/up) load shard by shard and stay exact when their shards' scales
differ: per-tensor scales become one scale per output row, and 128-row block scales stay 128-row
blocks only when every shard starts on a block row (else one scale row per weight row).

On CUDA (kernels/fp8_gemm.py): one row of x goes through the FMA kernel, weight-only; 2 to 16
rows, where the layout's prefill is W8A8, through the few-row W8A8 kernel (x quantized in the
kernel as the prefill quantizes it), else through the weight-only few-row kernels; more rows
through the layout's prefill: W8A8 with activations quantized per token (`torch._scaled_mm`) or
per 128-column group (a Triton block-scaled GEMM), or, for MX scales (Hopper has no MX MMA), the
tensor-core kernel over any rows with the weight dequantized in registers. Elsewhere the weight
is dequantized a slab of rows at a time and multiplied by torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError, ModelLoadError
from tokenmill.numerics import FP8_E4M3, ScaleBlock, dequantize_blocks, scale_grid_shape
from tokenmill.quantization.base import LinearLayer, LinearMethod, set_weight_loader
from tokenmill.quantization.weight_loading import output_rows_loader

DEQUANT_ROWS = 4096
"""Rows of a weight dequantized at once where no kernel reads it (a CPU): a float32 slab, never
a whole float32 copy of a head (a transient the start-up memory profile never saw)."""

PREFILL_PATHS = ("w8a8-rows", "w8a8-blocks", "w8a16")


@dataclass(frozen=True)
class ScaleLayout:
    scale_name: str
    """The scale tensor's suffix in the checkpoint (weight_scale, weight_scale_inv)."""
    block: ScaleBlock
    """Weight rows and columns per scale as the checkpoint stores them ((1, 0): one per row or tensor)."""
    scale_dtype: torch.dtype
    """float32, or uint8 E8M0 codes."""
    prefill: str
    """One of PREFILL_PATHS: how more rows than the few-row kernels take are multiplied on CUDA."""
    input_scale: bool = False
    """The checkpoint stores a static per-tensor `input_scale` per layer: loaded and kept (a
    re-export writes it back) but not used, since activations are quantized per token."""

    def param_block(self, shard_rows: Sequence[int]) -> ScaleBlock:
        """The block the parameter stores: the checkpoint's when every shard starts on one of its
        block rows, else one scale row per weight row (the blocks repeated down their rows)."""
        rows, cols = self.block
        aligned = all(size % rows == 0 for size in shard_rows[:-1])
        return (rows if aligned else 1, cols)

    def fit(self, param_block: ScaleBlock):
        """The loader's fit: one checkpoint scale tensor into its slice of the parameter."""

        def fit(tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
            if self.block[1] == 0 and tensor.numel() == 1:  # a per-tensor scale over its shard's rows
                return tensor.reshape(1, 1).expand(dest.shape)
            if tensor.dim() == 4 and tensor.shape[1] == tensor.shape[3] == 1:  # ModelOpt's [rows, 1, cols, 1]
                tensor = tensor[:, 0, :, 0]
            if tensor.dim() < 2:
                tensor = tensor.reshape(-1, 1)
            if param_block[0] != self.block[0]:  # blocks spread to one scale row per weight row
                tensor = tensor.repeat_interleave(self.block[0], dim=-2)[..., : dest.shape[-2], :]
            return tensor

        return fit


class ScaledFp8LinearMethod(LinearMethod):
    """FP8 E4M3 weight [N, K] and its scales (`layout.scale_name`) of one linear layer."""

    def __init__(self, layout: ScaleLayout, prefix: str, use_triton: bool = False) -> None:
        self.layout = layout
        self.prefix = prefix
        self.use_triton = use_triton
        self.name = f"fp8 {layout.scale_name} {layout.block}"

    def create_weights(self, layer: LinearLayer, dtype: torch.dtype, device: torch.device | str | None) -> None:
        layout, sizes, k = self.layout, layer.output_sizes, layer.in_features
        check_block_columns(self.prefix, k, layout.block)
        weight = torch.zeros(layer.out_features, k, dtype=FP8_E4M3, device=device)
        layer.weight = set_weight_loader(nn.Parameter(weight, requires_grad=False), output_rows_loader(sizes),
                                         shards=layer.shards)
        block = layout.param_block(sizes)
        scale_rows = [scale_grid_shape(size, k, block)[0] for size in sizes]
        scale = torch.ones(sum(scale_rows), scale_grid_shape(1, k, block)[1], dtype=layout.scale_dtype, device=device)
        if layout.scale_dtype == torch.uint8:
            scale.fill_(127)  # E8M0 code of 1.0
        loader = output_rows_loader(scale_rows, layout.fit(block))
        layer.register_parameter(layout.scale_name, set_weight_loader(nn.Parameter(scale, requires_grad=False), loader,
                                                                      shards=layer.shards))
        layer.scale_block = block  # type: ignore[attr-defined]
        if layout.input_scale:
            register_input_scale(layer, len(sizes), device)

    def scales(self, layer: LinearLayer) -> torch.Tensor:
        return getattr(layer, self.layout.scale_name)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        weight, scale, block = layer.weight, self.scales(layer), layer.scale_block  # type: ignore[attr-defined]
        if self.use_triton and x.dim() == 2 and x.is_contiguous():
            from tokenmill.kernels.fp8_gemm import scaled_fp8_linear

            return scaled_fp8_linear(x, weight, scale, block, layer.bias, self.layout.prefill)
        return dequantized_linear(x, weight, scale, block, layer.bias)

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return dequantize_blocks(layer.weight, self.scales(layer), layer.scale_block)  # type: ignore[attr-defined]


def register_input_scale(layer: LinearLayer, shards: int, device: torch.device | str | None) -> None:
    """A float32 [shards] of each fused shard's static input scale."""
    values = torch.ones(shards, dtype=torch.float32, device=device)

    def fit(tensor: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
        if tensor.numel() != 1 and tensor.numel() != dest.numel():
            raise ModelLoadError(f"input_scale of {tensor.numel()} values where a per-tensor scale is read")
        return tensor.float().reshape(-1).expand(dest.shape)

    param = nn.Parameter(values, requires_grad=False)
    layer.register_parameter("input_scale", set_weight_loader(param, output_rows_loader([1] * shards, fit),
                                                              shards=list(range(shards)) if shards > 1 else None))


def check_block_columns(prefix: str, k: int, block: ScaleBlock) -> None:
    """MX scales cover whole groups of 32 columns: refuse a layer whose K is not a multiple."""
    cols = block[1]
    if cols and cols < 128 and k % cols:
        raise ConfigError(f"{prefix}: {k} input columns are not a multiple of the {cols}-column scale groups of "
                          "this checkpoint's format; keep this layer unquantized (exclude it) when quantizing")


def dequantized_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W.T (+ bias) with W dequantized DEQUANT_ROWS rows at a time, in x's dtype."""
    n = weight.shape[0]
    step = DEQUANT_ROWS - DEQUANT_ROWS % block[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        scale_rows = slice(start // block[0], -(-min(start + step, n) // block[0]))
        w = dequantize_blocks(weight[rows], scale[scale_rows], block).to(x.dtype)
        out[..., rows] = F.linear(x, w, None if bias is None else bias[rows])
    return out

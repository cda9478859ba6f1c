"""fused_experts: the routed experts of a MoE layer on the GPU, path chosen by token count.

    out[t] = sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])   (+ addend)
    expert_e(x) = (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

Up to FEW_ROWS tokens (decode, small batches) the few-row kernels stream each selected expert
once (few_row.py); more tokens sort their slots by expert and run the grouped GEMMs
(align.py, grouped_gemm.py). Both end in the same combine. tokenmill/quantization/unquantized_experts.py
holds the reference (fused_experts_ref). No host sync, every buffer sized from T * k: it runs
inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

from tokenmill.kernels._common import FP8_DTYPE
from tokenmill.kernels.moe.align import align_slots
from tokenmill.kernels.moe.combine import combine
from tokenmill.kernels.moe.few_row import FEW_ROWS, few_row_experts
from tokenmill.kernels.moe.grouped_gemm import grouped_experts, grouped_tiles
from tokenmill.kernels.moe.scales import ExpertScales
from tokenmill.numerics import NVFP4_GROUP

__all__ = ["ExpertScales", "fused_experts", "uses_few_row_path"]


def uses_few_row_path(num_tokens: int) -> bool:
    """The one rule choosing the path: few-row kernels while every expert's rows fit one MMA's
    narrow side (a token chooses an expert at most once, so an expert has at most T rows)."""
    return num_tokens <= FEW_ROWS


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    addend: torch.Tensor | None = None,
    addend_gate: torch.Tensor | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights float32
    [T, k]; topk_ids int32 [T, k]; addend [T, H] added to the result, times sigmoid(addend_gate
    [T, 1]) if given; FP8 E4M3 weights, or NVFP4 ones (uint8 [E, 2I, H / 2] and [E, H, I / 2]),
    with their `scales`. Returns [T, H] in x's dtype."""
    check_experts_operands(x, w13, w2, topk_weights, topk_ids, scales)
    num_tokens, top_k = topk_ids.shape
    x = x.contiguous()
    topk_weights = topk_weights.contiguous()
    topk_ids = topk_ids.contiguous()
    if num_tokens == 0:
        return torch.empty_like(x)
    if uses_few_row_path(num_tokens):
        slot_out = few_row_experts(x, w13, w2, topk_weights, topk_ids, scales=scales)
    else:
        tiles = grouped_tiles(topk_ids.numel(), w13.shape[0])
        layout = align_slots(topk_ids, w13.shape[0], tiles[0].block_m)
        slot_out = grouped_experts(x, w13, w2, topk_weights, layout, top_k, tiles, scales)
    return combine(slot_out, top_k, addend, addend_gate)


def check_experts_operands(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    scales: ExpertScales | None = None,
) -> None:
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(w13.shape)}, {tuple(w2.shape)}")
    fp4 = w13.dtype == torch.uint8
    pack = 2 if fp4 else 1
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], w13.shape[2] * pack
    if w2.shape != (num_experts, hidden, two_inter // 2 // pack):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {two_inter // 2 // pack}] beside w13 {tuple(w13.shape)}, "
                         f"got {tuple(w2.shape)}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights must be row-major in their last dimension")
    quantized = w13.dtype in (FP8_DTYPE, torch.uint8)
    if (scales is not None) != quantized or w2.dtype != w13.dtype or (scales is not None and scales.fp4 != fp4):
        raise ValueError(f"FP8 expert weights need their scales (NVFP4 ones their block and row scales), and only "
                         f"quantized weights take scales (w13 {w13.dtype}, w2 {w2.dtype})")
    if fp4 and (hidden % NVFP4_GROUP or two_inter // 2 % NVFP4_GROUP):
        raise ValueError(f"NVFP4 experts need H and I multiples of {NVFP4_GROUP}, got H = {hidden}, I = {two_inter // 2}")
    weight_dtype = x.dtype if scales is not None else w13.dtype
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != weight_dtype or not x.is_floating_point():
        raise ValueError(f"x must be [T, {hidden}] in the weights' dtype {w13.dtype}, got {tuple(x.shape)} {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32 [{x.shape[0]}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")

"""Routing on the device: router logits [T, E] -> (weights float32 [T, k], ids int32 [T, k]).

The rule and its tie-breaking are tokenmill/layers/moe/routing.py's (select_experts_ref is the
reference). One program per token holds the token's E logits as a [groups, group size] tile
(an ungrouped router is one group), so group scores are row reductions, and picks the k experts
by k rounds of max -> lowest index at that max -> mask it out. All of it stays on the device:
no host sync, shapes fixed by T, so it runs inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import next_pow2

NO_INDEX = tl.constexpr(1 << 30)  # above every expert and group index: the identity of a min over indices


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_lt, group_size, scale,
    TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    TOP2_GROUP_SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0)
    group = tl.arange(0, BLOCK_G)
    member = tl.arange(0, BLOCK_S)[None, :]
    valid = (group[:, None] < N_GROUP) & (member < group_size)
    expert = tl.where(valid, group[:, None] * group_size + member, NO_INDEX)
    logits = tl.load(logits_ptr + token.to(tl.int64) * stride_lt + expert, mask=valid, other=float("-inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(logits - tl.max(tl.max(logits, 1), 0))
        scores = shifted / tl.sum(tl.sum(shifted, 1), 0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if N_GROUP > 1:
        best = tl.max(choice, 1)
        group_score = best
        if TOP2_GROUP_SCORE:
            first = tl.min(tl.where(choice == best[:, None], member, NO_INDEX), 1)
            group_score = best + tl.max(tl.where(member == first[:, None], float("-inf"), choice), 1)
        group_score = tl.where(group < N_GROUP, group_score, float("-inf"))
        kept = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == top, group, NO_INDEX), 0)
            kept = kept | (group == pick)
            group_score = tl.where(group == pick, float("-inf"), group_score)
        choice = tl.where(kept[:, None], choice, float("-inf"))

    slot = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, NO_INDEX), 1), 0)
        chosen = expert == pick
        top_weights = tl.where(slot == i, tl.sum(tl.sum(tl.where(chosen, scores, 0.0), 1), 0), top_weights)
        top_ids = tl.where(slot == i, pick, top_ids)
        choice = tl.where(chosen, float("-inf"), choice)
    if RENORMALIZE:
        top_weights = top_weights / (tl.sum(top_weights, 0) + 1e-20)
    out = token.to(tl.int64) * TOP_K + slot
    tl.store(weights_ptr + out, top_weights * scale, mask=slot < TOP_K)
    tl.store(ids_ptr + out, top_ids, mask=slot < TOP_K)


def route_launch_config(num_experts: int, n_group: int, top_k: int) -> dict[str, int]:
    """Constexprs and warps of the routing kernel for a router shape."""
    group_size = num_experts // n_group
    return dict(BLOCK_G=next_pow2(n_group), BLOCK_S=next_pow2(group_size), BLOCK_K=next_pow2(top_k),
                num_warps=1 if next_pow2(n_group) * next_pow2(group_size) <= 256 else 4)


def route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    sigmoid: bool,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    top2_group_score: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], ids int32 [T, top_k]) for logits [T, E]; n_group = 1 selects
    among all experts. The arguments are RoutingConfig's, validated there."""
    num_tokens, num_experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    launch = route_launch_config(num_experts, n_group, top_k)
    _route_kernel[(num_tokens,)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids, logits.stride(0),
        num_experts // n_group, float(scale), TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
        SIGMOID=sigmoid, HAS_BIAS=correction_bias is not None, TOP2_GROUP_SCORE=top2_group_score,
        RENORMALIZE=renormalize, **launch,
    )
    return weights, ids

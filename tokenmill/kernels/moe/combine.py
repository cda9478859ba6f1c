"""out[t] = sum over j of slot_out[t * k + j] (+ addend[t], times sigmoid(addend_gate[t]) if given).

The sum over each token's k weighted expert outputs, in float32 and in the order of its
choices, so a token's result does not depend on where its slots were computed; the addend is a
shared expert's output (Qwen2-MoE gates it by a sigmoid of one logit per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 1024


@triton.jit
def _combine_kernel(
    slot_ptr, add_ptr, gate_ptr, out_ptr, hidden, stride_s, stride_a, stride_g, stride_o,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(slot_ptr + (token * TOP_K + j) * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        add = tl.load(add_ptr + token * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_GATE:
            add = add / (1.0 + tl.exp(-tl.load(gate_ptr + token * stride_g).to(tl.float32)))
        acc += add
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(
    slot_out: torch.Tensor, top_k: int, addend: torch.Tensor | None = None, addend_gate: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, H] from slot_out [T * k, H]; addend [T, H], addend_gate [T, 1] (a logit per token)."""
    hidden = slot_out.shape[1]
    num_tokens = slot_out.shape[0] // top_k
    out = torch.empty(num_tokens, hidden, dtype=slot_out.dtype, device=slot_out.device)
    if num_tokens == 0:
        return out
    if addend_gate is not None and addend is None:
        raise ValueError("an addend gate needs an addend")
    _combine_kernel[(num_tokens, triton.cdiv(hidden, BLOCK_H))](
        slot_out, addend if addend is not None else slot_out, addend_gate if addend_gate is not None else slot_out, out,
        hidden, slot_out.stride(0), addend.stride(0) if addend is not None else 0,
        addend_gate.stride(0) if addend_gate is not None else 0, out.stride(0),
        TOP_K=top_k, HAS_ADD=addend is not None, HAS_GATE=addend_gate is not None, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return out

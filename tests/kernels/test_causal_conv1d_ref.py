"""The PyTorch causal conv1d over the slot pool against transformers' causal_conv1d_fn (a whole
sequence) and causal_conv1d_update (decode steps), then the pool contract: packed requests,
resuming, windows shorter than the kernel, checkpoints, slots never read without initial state."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import checkpoint_slots, conv_batch
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

from tokenmill.kernels.causal_conv1d import causal_conv1d_ref

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_prefill_then_decode_match_transformers(bias: bool, activation: str | None) -> None:
    """Two fresh requests prefilled together, then three decode steps: each output row equals
    transformers' on the request alone, and the window it keeps feeds the next step."""
    batch = conv_batch([9, 2], [False, False], bias=bias)
    out = causal_conv1d_ref(*batch.args(), activation=activation)
    width = batch.weight.shape[1]
    hf_states = []
    for r in range(2):
        rows = slice(int(batch.cu_seqlens[r]), int(batch.cu_seqlens[r + 1]))
        x = batch.x[rows].t()[None]
        want = causal_conv1d_fn(x, batch.weight, batch.bias, activation=activation)[0].t()
        torch.testing.assert_close(out[rows], want, **TOL)
        hf_states.append(torch.nn.functional.pad(x, (width - x.shape[-1], 0))[..., -width:].clone())
    ones = torch.ones(2, dtype=torch.bool)
    for step in range(3):
        x_step = torch.randn(2, batch.x.shape[1], generator=torch.Generator().manual_seed(step))
        out = causal_conv1d_ref(x_step, batch.weight, batch.bias, batch.conv_state, batch.slots,
                                torch.tensor([0, 1, 2], dtype=torch.int32), ones, activation=activation)
        for r in range(2):
            want = causal_conv1d_update(x_step[r, :, None][None], hf_states[r], batch.weight, batch.bias, activation)
            torch.testing.assert_close(out[r], want[0, :, 0], **TOL)


def test_split_call_resumes_from_slot_and_short_windows_keep_zeros() -> None:
    """One call over 7 rows equals calls over 1, 1 and 5 rows resuming from the slot: the first
    calls leave windows that are partly the zeros before the first input."""
    whole = conv_batch([7], [False])
    out_whole = causal_conv1d_ref(*whole.args())
    parts = conv_batch([7], [False])
    outs = []
    for lo, hi in ((0, 1), (1, 2), (2, 7)):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        outs.append(causal_conv1d_ref(parts.x[lo:hi], parts.weight, parts.bias, parts.conv_state, parts.slots, cu,
                                      torch.tensor([lo > 0])))
        if hi == 1:
            window = parts.conv_state[int(parts.slots[0])]
            assert window[:-1].eq(0).all() and torch.equal(window[-1], parts.x[0])
    torch.testing.assert_close(torch.cat(outs), out_whole, **TOL)
    torch.testing.assert_close(parts.conv_state, whole.conv_state, **TOL)


def test_checkpoints_hold_the_window_after_their_row() -> None:
    batch = conv_batch([6, 3], [True, False], spare_slots=4)
    spare = sorted(set(range(batch.conv_state.shape[0])) - set(batch.slots.tolist()))
    marks = {0: spare[0], 4: spare[1], 6: spare[2], 8: spare[3]}
    before = batch.conv_state.clone()
    causal_conv1d_ref(*batch.args(), checkpoint_slots=checkpoint_slots(9, marks))
    for token, slot in marks.items():
        r = 0 if token < 6 else 1
        start = int(batch.cu_seqlens[r])
        state = before.clone()
        cu = torch.tensor([0, token + 1 - start], dtype=torch.int32)
        causal_conv1d_ref(batch.x[start : token + 1], batch.weight, batch.bias, state, batch.slots[r : r + 1], cu,
                          batch.has_initial_state[r : r + 1])
        torch.testing.assert_close(batch.conv_state[slot], state[int(batch.slots[r])], **TOL)


def test_fresh_request_never_reads_its_slot() -> None:
    batch = conv_batch([5, 1], [False, False])
    batch.conv_state[batch.slots.long()] = float("nan")
    out = causal_conv1d_ref(*batch.args())
    assert torch.isfinite(out).all() and torch.isfinite(batch.conv_state[batch.slots.long()]).all()

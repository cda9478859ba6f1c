"""The PyTorch gated delta rule (recurrent and chunked forms) against transformers' own: Qwen3-Next's
torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (one gate per head) and
Kimi-Linear's KDA references (one gate per key channel); then the slot-pool contract: packed
requests, resuming from a slot, bf16 state, checkpoints, slots never read without initial state."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import checkpoint_slots, delta_batch
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from tokenmill.kernels.gated_delta_ref import gated_delta_rule_chunked_ref, gated_delta_rule_ref, plan_chunks

FORMS = {"recurrent": gated_delta_rule_ref, "chunked": gated_delta_rule_chunked_ref}
TOL = dict(atol=2e-5, rtol=2e-5)


def transformers_oracle(batch, r: int, per_channel: bool, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Request r alone through transformers ([1, L, H, D] layout), from its slot if it has one."""
    rows = batch.rows(r)
    q, k, v, g, beta = (x[rows][None] for x in (batch.q, batch.k, batch.v, batch.g, batch.beta))
    initial = batch.state[int(batch.slots[r])][None].clone() if bool(batch.has_initial_state[r]) else None
    if per_channel:
        fn = chunk_kimi_delta_attention if chunked else recurrent_kimi_delta_attention
    else:
        fn = torch_chunk_gated_delta_rule if chunked else torch_recurrent_gated_delta_rule
    out, final = fn(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_matches_transformers_per_request(form: str, per_channel: bool) -> None:
    """Three packed requests (one crossing two chunk boundaries, one resuming from its slot) in
    shuffled slots, each equal to transformers run on it alone: output and final state."""
    heads = dict(key_heads=2, value_heads=2) if per_channel else dict(key_heads=2, value_heads=4)  # KDA oracle: Hv == Hk
    batch = delta_batch([70, 5, 130], [False, True, True], per_channel=per_channel, **heads)
    before = batch.state.clone()
    out = FORMS[form](*batch.args(), scale=batch.scale)
    for r in range(3):
        for chunked in (False, True):
            saved, batch.state = batch.state, before
            want_out, want_state = transformers_oracle(batch, r, per_channel, chunked)
            batch.state = saved
            torch.testing.assert_close(out[batch.rows(r)], want_out, **TOL)
            torch.testing.assert_close(batch.state[int(batch.slots[r])], want_state, **TOL)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_forms_agree_with_grouped_heads(per_channel: bool) -> None:
    """Hv = 3 Hk (Qwen4Exp's grouping): the chunked form equals the recurrent one, so the value
    head h reads key head h // 3 in both; transformers' repeat_interleave fixes the convention."""
    batch = delta_batch([67, 1, 3], [True, False, True], key_heads=2, value_heads=6, per_channel=per_channel)
    before = batch.state.clone()
    if not per_channel:
        want, _ = transformers_oracle(batch, 0, False, chunked=False)
    out = gated_delta_rule_ref(*batch.args(), scale=batch.scale)
    recurrent_state, batch.state = batch.state, before.clone()
    out_chunked = gated_delta_rule_chunked_ref(*batch.args(), scale=batch.scale)
    torch.testing.assert_close(out_chunked, out, **TOL)
    torch.testing.assert_close(batch.state, recurrent_state, **TOL)
    if not per_channel:
        torch.testing.assert_close(out[batch.rows(0)], want, **TOL)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_split_sequence_resumes_from_slot(form: str, per_channel: bool, state_dtype: torch.dtype) -> None:
    """One call over 100 tokens equals a call over 37 then one over 63 resuming from the slot;
    with a bf16 pool the state is rounded once more at the split, so the tolerance is bf16's."""
    fn = FORMS[form]
    whole = delta_batch([100], [False], state_dtype=state_dtype, per_channel=per_channel)
    out_whole = fn(*whole.args(), scale=whole.scale)
    slot = int(whole.slots[0])
    first = delta_batch([100], [False], state_dtype=state_dtype, per_channel=per_channel)
    parts = []
    for lo, hi, initial in ((0, 37, False), (37, 100, True)):
        tokens = [x[lo:hi] for x in (first.q, first.k, first.v, first.g, first.beta)]
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        parts.append(fn(*tokens, first.state, first.slots, cu, torch.tensor([initial]), scale=first.scale))
    tol = TOL if state_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(torch.cat(parts), out_whole, **tol)
    torch.testing.assert_close(first.state[slot].float(), whole.state[slot].float(), **tol)


@pytest.mark.parametrize("form", FORMS)
def test_bf16_state_rounds_on_store_only(form: str) -> None:
    """A bf16 pool: the math runs in float32 from the rounded initial state and the final state is
    the float32 result rounded once."""
    batch = delta_batch([20, 9], [True, True], state_dtype=torch.bfloat16, dtype=torch.bfloat16)
    wide = delta_batch([20, 9], [True, True], state_dtype=torch.bfloat16, dtype=torch.bfloat16)
    wide.state = wide.state.float()
    out = FORMS[form](*batch.args(), scale=batch.scale)
    out_wide = gated_delta_rule_ref(*wide.args(), scale=wide.scale)
    assert out.dtype == torch.bfloat16 and batch.state.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), out_wide.float(), atol=1e-2, rtol=1e-2)
    for r in range(2):
        slot = int(batch.slots[r])
        torch.testing.assert_close(batch.state[slot], wide.state[slot].to(torch.bfloat16), atol=1e-2, rtol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_checkpoints_hold_the_state_after_their_token(form: str, per_channel: bool) -> None:
    """Checkpoints after tokens 0, 40 (inside a chunk) and 63, 64 (either side of a chunk edge)
    of request 0 and after the last token of request 1 equal the final state of a call that
    stops there."""
    lengths = [90, 6]
    batch = delta_batch(lengths, [True, False], per_channel=per_channel, spare_slots=6)
    spare = sorted(set(range(batch.state.shape[0])) - set(batch.slots.tolist()))
    marks = {0: spare[0], 40: spare[1], 63: spare[2], 64: spare[3], 95: spare[4]}
    before = batch.state.clone()
    out = FORMS[form](*batch.args(), scale=batch.scale, checkpoint_slots=checkpoint_slots(96, marks))
    for token, slot in marks.items():
        r = 0 if token < lengths[0] else 1
        start = int(batch.cu_seqlens[r])
        prefix = delta_batch(lengths, [True, False], per_channel=per_channel, spare_slots=6)
        prefix.state = before.clone()
        tokens = [x[start : token + 1] for x in (prefix.q, prefix.k, prefix.v, prefix.g, prefix.beta)]
        cu = torch.tensor([0, token + 1 - start], dtype=torch.int32)
        sub_out = gated_delta_rule_ref(*tokens, prefix.state, prefix.slots[r : r + 1], cu,
                                       prefix.has_initial_state[r : r + 1], scale=prefix.scale)
        torch.testing.assert_close(batch.state[slot], prefix.state[int(batch.slots[r])], **TOL)
        torch.testing.assert_close(out[start : token + 1], sub_out, **TOL)


@pytest.mark.parametrize("form", FORMS)
def test_fresh_request_never_reads_its_slot(form: str) -> None:
    batch = delta_batch([66, 2], [False, False])
    batch.state[batch.slots.long()] = float("nan")
    out = FORMS[form](*batch.args(), scale=batch.scale)
    assert torch.isfinite(out).all() and torch.isfinite(batch.state[batch.slots.long()]).all()


def test_chunk_plan_cuts_at_requests_and_checkpoints() -> None:
    plan = plan_chunks([0, 70, 70, 75], checkpoint_tokens=[9, 63, 72], chunk_size=32)
    assert plan.chunk_starts == [0, 10, 42, 64, 70, 73, 75]
    assert plan.chunk_offsets == [0, 4, 4, 6]

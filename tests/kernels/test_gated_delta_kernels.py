"""The Triton gated-delta-rule kernels (chunked prefill, recurrent decode/verification) against the
PyTorch reference: under TRITON_INTERPRET=1 at tiny shapes on CPU, at real head sizes on CUDA."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import checkpoint_slots, conv_batch, delta_batch
from kernel_cases import on_cpu, on_gpu
from no_host_sync import forbid_host_reads

from tokenmill.kernels import causal_conv1d_triton, gated_delta_recurrent
from tokenmill.kernels.causal_conv1d import causal_conv1d
from tokenmill.kernels.gated_delta import gated_delta_rule, uses_recurrent_path
from tokenmill.kernels.gated_delta_chunk import chunk_gated_delta_rule
from tokenmill.kernels.gated_delta_recurrent import recurrent_gated_delta_rule
from tokenmill.kernels.gated_delta_ref import gated_delta_rule_ref

TINY = dict(key_heads=2, value_heads=4, key_dim=8, value_dim=16)
TOLS = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def compare(fn, batch, marks: dict[int, int] | None = None, **kwargs) -> None:
    """fn and the reference from the same pool: outputs, every slot afterwards (request slots,
    checkpoint slots, and untouched ones)."""
    total = batch.q.shape[0]
    ckpt = checkpoint_slots(total, marks, batch.q.device.type) if marks else None
    pool = batch.state.clone()
    out = fn(*batch.args(), scale=batch.scale, checkpoint_slots=ckpt, **kwargs)
    want_pool = pool.cpu()
    args = [x.cpu() for x in batch.args()]
    args[5] = want_pool
    want = gated_delta_rule_ref(*args, scale=batch.scale, checkpoint_slots=None if ckpt is None else ckpt.cpu())
    tol = TOLS[batch.v.dtype if batch.state.dtype == torch.float32 else torch.bfloat16]
    torch.testing.assert_close(out.cpu().float(), want.float(), **tol)
    torch.testing.assert_close(batch.state.cpu().float(), want_pool.float(), **tol)


def spare(batch, n: int) -> list[int]:
    return sorted(set(range(batch.state.shape[0])) - set(batch.slots.tolist()))[:n]


QWEN3_NEXT = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128)
QWEN4EXP = dict(key_heads=16, value_heads=48, key_dim=128, value_dim=128)
KIMI = dict(key_heads=32, value_heads=32, key_dim=128, value_dim=128)


@pytest.mark.parametrize(
    "per_channel,lengths,chunk,dtype,state_dtype,heads,device",
    [
        # On CPU most cases use chunks of 16 (the same kernel code) so tiny batches cross several.
        on_cpu(False, [70, 3], 64, torch.float32, torch.float32, TINY, id="gdn-chunks-of-64"),
        on_cpu(False, [64], 64, "correlated", torch.float32, TINY, id="gdn-chunks-of-64-correlated-keys"),
        on_cpu(False, [40, 5, 21], 16, torch.float32, torch.float32, TINY, id="gdn-three-requests"),
        on_cpu(True, [40, 5, 21], 16, torch.float32, torch.float32, TINY, id="kda-three-requests"),
        on_cpu(False, [34, 3], 16, torch.bfloat16, torch.bfloat16, TINY, id="gdn-bf16-inputs-bf16-state"),
        on_cpu(True, [34, 3], 16, torch.bfloat16, torch.float32, TINY, id="kda-bf16-inputs"),
        on_gpu(False, [2048, 300, 5], 64, torch.bfloat16, torch.float32, QWEN3_NEXT, id="gdn-qwen3-next"),
        on_gpu(False, [700, 64], 64, torch.bfloat16, torch.bfloat16, QWEN4EXP, id="gdn-qwen4exp-bf16-state"),
        on_gpu(True, [1000, 65], 64, torch.bfloat16, torch.float32, KIMI, id="kda-kimi"),
        on_gpu(False, [130, 7], 64, torch.float32, torch.float32, QWEN3_NEXT, id="gdn-float32"),
    ],
)
def test_chunked_matches_reference(per_channel: bool, lengths: list[int], chunk: int, dtype, state_dtype, heads,
                                   device: str) -> None:
    initial = [r % 2 == 1 for r in range(len(lengths))]
    correlated = dtype == "correlated"  # weak decay, keys near one direction: T far from the identity
    batch = delta_batch(lengths, initial, per_channel=per_channel, dtype=torch.float32 if correlated else dtype,
                        state_dtype=state_dtype, device=device, correlated_keys=correlated,
                        gate_scale=0.05 if correlated else 1.0, **heads)
    compare(chunk_gated_delta_rule, batch, chunk_size=chunk)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_chunked_checkpoints_split_chunks(per_channel: bool, device: str) -> None:
    """Checkpoints inside a chunk, on either side of a chunk edge and at a request's last token;
    the chunk plan cuts there, so the state at each is a chunk's end state."""
    batch = delta_batch([40, 6], [True, False], per_channel=per_channel, spare_slots=6, **TINY)
    slots = spare(batch, 5)
    compare(chunk_gated_delta_rule, batch, {0: slots[0], 21: slots[1], 31: slots[2], 32: slots[3], 45: slots[4]},
            chunk_size=16)


@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_chunked_resumes_mid_sequence(device: str) -> None:
    """Chunked prefill across steps: 21 tokens, then 29 more from the slot, equal one call of 50."""
    whole = delta_batch([50], [False], **TINY)
    out_whole = chunk_gated_delta_rule(*whole.args(), scale=whole.scale, chunk_size=16)
    parts = delta_batch([50], [False], **TINY)
    outs = []
    for lo, hi in ((0, 21), (21, 50)):
        tokens = [x[lo:hi] for x in (parts.q, parts.k, parts.v, parts.g, parts.beta)]
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        outs.append(chunk_gated_delta_rule(*tokens, parts.state, parts.slots, cu, torch.tensor([lo > 0]), scale=parts.scale,
                                           chunk_size=16))
    torch.testing.assert_close(torch.cat(outs), out_whole, **TOLS[torch.float32])
    torch.testing.assert_close(parts.state, whole.state, **TOLS[torch.float32])


@pytest.mark.parametrize(
    "per_channel,tokens_per_request,state_dtype,device",
    [
        on_cpu(False, 1, torch.float32, id="gdn-decode"),
        on_cpu(True, 1, torch.bfloat16, id="kda-decode-bf16-state"),
        on_cpu(False, 5, torch.bfloat16, id="gdn-verify-1+4-bf16-state"),
        on_cpu(True, 4, torch.float32, id="kda-verify-1+3"),
        on_gpu(False, 1, torch.float32, id="gdn-decode-qwen3-next"),
        on_gpu(False, 4, torch.bfloat16, id="gdn-verify-qwen3-next-bf16-state"),
        on_gpu(True, 1, torch.bfloat16, id="kda-decode-kimi"),
    ],
)
def test_recurrent_with_checkpoint_per_position(per_channel: bool, tokens_per_request: int, state_dtype, device: str) -> None:
    """Three requests (one fresh, its slot full of NaN that must not be read), a checkpoint after
    every position of the last request, as speculative verification keeps them."""
    heads = TINY if device == "cpu" else KIMI if per_channel else QWEN3_NEXT
    n = tokens_per_request
    batch = delta_batch([n, n, n], [True, False, True], per_channel=per_channel, state_dtype=state_dtype,
                        dtype=torch.bfloat16 if device == "cuda" else torch.float32, spare_slots=n + 2, device=device, **heads)
    batch.state[int(batch.slots[1])] = float("nan")
    marks = dict(zip(range(2 * n, 3 * n), spare(batch, n)))
    compare(recurrent_gated_delta_rule, batch, marks)
    assert torch.isfinite(batch.state[int(batch.slots[1])]).all()


@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_public_entry_dispatches_by_shape(device: str) -> None:
    """Decode and verification shapes take the recurrent kernel, prefill the chunked one; both
    give the reference's answer through the public function, from q, k, v that are views of one
    projection (as the layers split it) and int64 slots (as the engine keeps them)."""
    assert uses_recurrent_path(64 * 5, 64) and uses_recurrent_path(1, 1) and not uses_recurrent_path(100, 2)
    for lengths in ([1, 1, 1, 1], [20, 2]):
        batch = delta_batch(lengths, [True] * len(lengths), **TINY)
        width = [x.shape[1] * x.shape[2] for x in (batch.q, batch.k, batch.v)]
        mixed = torch.cat([x.flatten(1) for x in (batch.q, batch.k, batch.v)], dim=1)
        batch.q, batch.k, batch.v = (part.unflatten(1, x.shape[1:]) for part, x in
                                     zip(mixed.split(width, dim=1), (batch.q, batch.k, batch.v)))
        assert not batch.q.is_contiguous()
        batch.slots = batch.slots.long()
        compare(gated_delta_rule, batch)


@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_decode_and_verify_never_read_the_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrent path (and the conv update) launch with no host read of any tensor, so a
    CUDA graph can capture them; checkpoint slots included."""
    batch = delta_batch([3, 3], [True, False], spare_slots=6, **TINY)
    conv = conv_batch([3, 3], [True, False], spare_slots=6)
    marks = checkpoint_slots(6, dict(zip(range(6), spare(batch, 6))))
    launches = []

    class Recorded:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.name)

    monkeypatch.setattr(gated_delta_recurrent, "_recurrent_kernel", Recorded("gdn"))
    monkeypatch.setattr(causal_conv1d_triton, "_conv_update_kernel", Recorded("conv"))
    forbid_host_reads(monkeypatch, "decode / verification")
    gated_delta_rule(*batch.args(), scale=batch.scale, checkpoint_slots=marks)
    causal_conv1d(*conv.args(), checkpoint_slots=marks)
    assert launches == ["gdn", "conv"]

"""The Triton causal conv1d kernels (token-parallel prefill + window update, and the sequential
update path for decode / verification) against the PyTorch reference: under TRITON_INTERPRET=1
at tiny shapes on CPU, at Qwen3-Next's conv width on CUDA."""

from __future__ import annotations

import pytest
import torch
from gdn_cases import checkpoint_slots, conv_batch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from tokenmill.kernels.causal_conv1d_triton import causal_conv1d_triton

TOLS = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
QWEN3_NEXT_CONV = 2 * 16 * 128 + 32 * 128


def compare(batch, marks: dict[int, int] | None, update_only: bool, activation: str | None = "silu") -> None:
    ckpt = checkpoint_slots(batch.x.shape[0], marks, batch.x.device.type) if marks else None
    want_pool = batch.conv_state.cpu().clone()
    args = [x.cpu() if x is not None else None for x in batch.args()]
    args[3] = want_pool
    want = causal_conv1d_ref(*args, activation=activation, checkpoint_slots=None if ckpt is None else ckpt.cpu())
    out = causal_conv1d_triton(*batch.args(), activation=activation, checkpoint_slots=ckpt, update_only=update_only)
    tol = TOLS[batch.x.dtype]
    torch.testing.assert_close(out.cpu(), want, **tol)
    torch.testing.assert_close(batch.conv_state.cpu(), want_pool, **tol)


def spare(batch, n: int) -> list[int]:
    return sorted(set(range(batch.conv_state.shape[0])) - set(batch.slots.tolist()))[:n]


@pytest.mark.parametrize(
    "lengths,initial,dtype,bias,channels,device",
    [
        on_cpu([9, 1, 2, 6], [False, True, True, False], torch.float32, True, 40, id="four-requests-short-windows"),
        on_cpu([5, 7], [True, True], torch.bfloat16, False, 24, id="bf16-no-bias"),
        on_gpu([2048, 3, 300], [False, True, True], torch.bfloat16, False, QWEN3_NEXT_CONV, id="qwen3-next"),
    ],
)
def test_prefill_matches_reference(lengths, initial, dtype, bias: bool, channels: int, device: str) -> None:
    """Token tiles of 4 on CPU cross requests' edges; a request shorter than the kernel keeps part
    of its old window (or zeros); checkpoints inside, at the end of, and right after a request."""
    batch = conv_batch(lengths, initial, dtype=dtype, bias=bias, channels=channels, spare_slots=4, device=device)
    slots = spare(batch, 4)
    marks = {0: slots[0], 5: slots[1], 8: slots[2], 10: slots[3]}
    compare(batch, marks, update_only=False)


@pytest.mark.parametrize(
    "rows,dtype,device",
    [
        on_cpu(1, torch.float32, id="decode"),
        on_cpu(4, torch.bfloat16, id="verify-1+3-bf16"),
        on_gpu(1, torch.bfloat16, id="decode-qwen3-next"),
        on_gpu(5, torch.bfloat16, id="verify-1+4-qwen3-next"),
    ],
)
def test_update_path_with_checkpoint_per_position(rows: int, dtype, device: str) -> None:
    """Decode / verification: three requests (one fresh, its slot NaN and never read), every
    position of the last one checkpointed."""
    channels = 40 if device == "cpu" else QWEN3_NEXT_CONV
    batch = conv_batch([rows] * 3, [True, False, True], dtype=dtype, channels=channels, spare_slots=rows + 1,
                       device=device)
    batch.conv_state[int(batch.slots[1])] = float("nan")
    compare(batch, dict(zip(range(2 * rows, 3 * rows), spare(batch, rows))), update_only=True, activation=None)
    assert torch.isfinite(batch.conv_state[int(batch.slots[1])]).all()


@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_public_entry_picks_the_path_by_shape(device: str) -> None:
    for lengths in ([1, 1, 1], [20, 3]):
        batch = conv_batch(lengths, [True] * len(lengths))
        want_pool = batch.conv_state.clone()
        want = causal_conv1d_ref(*batch.args()[:3], want_pool, *batch.args()[4:])
        out = causal_conv1d(*batch.args())
        torch.testing.assert_close(out, want, **TOLS[torch.float32])
        torch.testing.assert_close(batch.conv_state, want_pool, **TOLS[torch.float32])

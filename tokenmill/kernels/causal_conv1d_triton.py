"""Triton causal conv1d over the slot pool (contract and reference: causal_conv1d.py).

Row e of a request's extended input ext = (window before the call) ++ (its rows of x) is x row
start + e - (K-1) when e >= K-1, else row e of its slot's window (zeros for a fresh request).

- _conv_update_kernel, one program per (request, channel block): steps through the request's
  rows (outputs, checkpoint windows), then stores the last K-1 rows of ext into the slot. Alone
  it is the decode / verification path: no host reads, graph-safe. A program writes only its own
  slot's channels, after reading them, through one layout, so no other thread reads what it
  overwrites (row j is written after old row L + j > j was read, L >= 1 rows).
- _conv_prefill_kernel, one program per (token tile, channel block), tiles numbered per request
  as in paged_attention.py: outputs and checkpoint windows in parallel; the update kernel
  (outputs off) then stores the windows, once every read of the old ones is done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels._common import and_flag, interpreting
from tokenmill.kernels.paged_attention import _request_tile

# On a GPU: (rows, channels, warps) of a prefill program and (channels, warps) of an update
# program; wider prefill tiles spill on sm_90.
PREFILL_TILE = (32, 128, 8)
UPDATE_TILE = (256, 2)


@triton.jit
def _ext_rows(x_ptr, window_ptr, start, e, ch_ok, has_initial, stride_xt, stride_wk, WIDTH: tl.constexpr):
    """ext[e] for ext indices e (one per row) of one request: [len(e), BLOCK_C] float32."""
    from_x = e >= WIDTH - 1
    x = tl.load(x_ptr + (start + e - (WIDTH - 1))[:, None] * stride_xt, mask=from_x[:, None] & ch_ok[None, :], other=0.0)
    old = tl.load(window_ptr + e[:, None] * stride_wk, mask=and_flag((e < WIDTH - 1)[:, None] & ch_ok[None, :], has_initial),
                  other=0.0)
    return tl.where(from_x[:, None], x.to(tl.float32), old.to(tl.float32))


@triton.jit
def _conv_rows(x_ptr, window_ptr, w_ptr, bias_ptr, start, local, ch, ch_ok, has_initial, stride_xt, stride_wk, stride_wc,
               WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Outputs of the request's rows `local` (offsets from its first row): [len(local), BLOCK_C]."""
    acc = tl.zeros([local.shape[0], BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(WIDTH):
        tap = tl.load(w_ptr + ch * stride_wc + i, mask=ch_ok, other=0.0).to(tl.float32)
        acc += tap[None, :] * _ext_rows(x_ptr, window_ptr, start, local + i, ch_ok, has_initial, stride_xt, stride_wk, WIDTH)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _store_windows(x_ptr, window_ptr, dest_ptr, start, local, row_ok, ch, ch_ok, has_initial, stride_xt, stride_wk,
                   WIDTH: tl.constexpr):
    """The window after each row `local` (ext rows local + 1 .. local + K - 1) to dest_ptr
    [len(local)] (pointers to slot rows, channel 0 of window row 0)."""
    for j in tl.static_range(WIDTH - 1):
        rows = _ext_rows(x_ptr + ch[None, :], window_ptr + ch[None, :], start, local + 1 + j, ch_ok, has_initial,
                         stride_xt, stride_wk, WIDTH)
        tl.store(dest_ptr[:, None] + j * stride_wk + ch[None, :], rows.to(dest_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & ch_ok[None, :])


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, cu_seqlens_ptr, has_initial_ptr, checkpoint_ptr, out_ptr,
    channels, stride_xt, stride_ot, stride_ws, stride_wk, stride_wc,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    COMPUTE_OUT: tl.constexpr, HAS_CHECKPOINTS: tl.constexpr,
):
    req = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < channels
    slot = tl.load(slots_ptr + req).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + req) != 0
    start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64) - start
    window_ptr = state_ptr + slot * stride_ws
    one = tl.arange(0, 1).to(tl.int64)
    if COMPUTE_OUT or HAS_CHECKPOINTS:
        for local in range(0, length):
            rows = one + local
            if COMPUTE_OUT:
                o = _conv_rows(x_ptr + ch[None, :], window_ptr + ch[None, :], w_ptr, bias_ptr, start, rows, ch, ch_ok,
                               has_initial, stride_xt, stride_wk, stride_wc, WIDTH, BLOCK_C, HAS_BIAS, SILU)
                tl.store(out_ptr + (start + rows)[:, None] * stride_ot + ch[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=ch_ok[None, :])
            if HAS_CHECKPOINTS:
                checkpoint = tl.load(checkpoint_ptr + start + rows).to(tl.int64)
                _store_windows(x_ptr, window_ptr, state_ptr + checkpoint * stride_ws, start, rows, checkpoint >= 0, ch,
                               ch_ok, has_initial, stride_xt, stride_wk, WIDTH)
    for j in tl.static_range(WIDTH - 1):  # the new window: ext rows length .. length + K - 2, row j after reading
        e = one + length + j
        row = _ext_rows(x_ptr + ch[None, :], window_ptr + ch[None, :], start, e, ch_ok, has_initial, stride_xt,
                        stride_wk, WIDTH)
        tl.store(window_ptr + j * stride_wk + ch[None, :], row.to(state_ptr.dtype.element_ty), mask=ch_ok[None, :])


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, cu_seqlens_ptr, has_initial_ptr, checkpoint_ptr, out_ptr,
    num_requests, channels, stride_xt, stride_ot, stride_ws, stride_wk, stride_wc,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_CHECKPOINTS: tl.constexpr,
):
    tile = tl.program_id(0)
    req, start, length, tile_start = _request_tile(cu_seqlens_ptr, num_requests, tile, BLOCK_T)
    if tile_start >= length:
        return
    start = start.to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < channels
    local = (tile_start + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = local < length
    slot = tl.load(slots_ptr + req).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + req) != 0
    window_ptr = state_ptr + slot * stride_ws
    o = _conv_rows(x_ptr + ch[None, :], window_ptr + ch[None, :], w_ptr, bias_ptr, start, local, ch, ch_ok, has_initial,
                   stride_xt, stride_wk, stride_wc, WIDTH, BLOCK_C, HAS_BIAS, SILU)
    tl.store(out_ptr + (start + local)[:, None] * stride_ot + ch[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & ch_ok[None, :])
    if HAS_CHECKPOINTS:
        checkpoint = tl.load(checkpoint_ptr + start + local, mask=row_ok, other=-1).to(tl.int64)
        _store_windows(x_ptr, window_ptr, state_ptr + checkpoint * stride_ws, start, local, checkpoint >= 0, ch, ch_ok,
                       has_initial, stride_xt, stride_wk, WIDTH)


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    slots: torch.Tensor, cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor,
    *, activation: str | None, checkpoint_slots: torch.Tensor | None, update_only: bool,
    block_t: int | None = None, block_c: int | None = None,
) -> torch.Tensor:
    """As causal_conv1d.causal_conv1d (arguments checked there). update_only: one sequential pass
    per request (decode, verification); else the token-parallel kernel, then the window update.
    x rows and conv_state need a unit stride along channels. block_t / block_c: the
    prefill tile (None: chosen here)."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = slots.shape[0]
    out = torch.empty_like(x)
    if num_requests == 0:
        return out
    if x.stride(1) != 1 or conv_state.stride(2) != 1:
        raise ValueError("causal_conv1d needs x and conv_state contiguous along channels")
    on_gpu = x.device.type == "cuda" and not interpreting()
    has_checkpoints = checkpoint_slots is not None
    flags = has_initial_state.view(torch.int8)
    common = (x, weight, bias if bias is not None else weight, conv_state, slots, cu_seqlens, flags,
              checkpoint_slots if has_checkpoints else slots, out)
    strides = (x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0))
    consts = dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu")
    if not update_only and num_tokens:
        tile_t, tile_c, warps = PREFILL_TILE if on_gpu else (4, 16, 1)
        tile_t, tile_c = block_t or tile_t, block_c or tile_c
        _conv_prefill_kernel[(num_tokens // tile_t + num_requests, triton.cdiv(channels, tile_c))](
            *common, num_requests, channels, *strides, BLOCK_T=tile_t, BLOCK_C=tile_c,
            HAS_CHECKPOINTS=has_checkpoints, **consts, num_warps=warps,
        )
    update_c, warps = UPDATE_TILE if on_gpu else (16, 1)
    _conv_update_kernel[(num_requests, triton.cdiv(channels, update_c))](
        *common, channels, *strides, BLOCK_C=update_c, COMPUTE_OUT=update_only,
        HAS_CHECKPOINTS=update_only and has_checkpoints, **consts, num_warps=warps,
    )
    return out

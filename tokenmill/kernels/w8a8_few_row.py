"""Few-row W8A8 matmul on FP8 tensor cores: y = x @ W.T (+ b) for x [M, K] with M <= 16 (decode,
a verify step, a drafter's block), W [N, K] FP8 E4M3 with one float32 scale per row or per
128 x 128 block, x quantized to E4M3 inside the kernel, as the W8A8 prefill quantizes it:

- per-row weight scales: x per token (amax of the row over all K / 448), a first pass over x's
  row before the weight stream;
- 128 x 128 block scales: x per token per 128 columns, each strip's scale from the strip itself,
  the strip's partial product times x's and W's scales.

Each program owns BLOCK_N rows of W and walks K in strips, W_strip @ q^T ([BLOCK_N, BLOCK_K] @
[BLOCK_K, 16], x's rows padded with zeros to the MMA's 16). The weight reaches the MMA as its
bytes, never widened in registers (what bounds the weight-only kernels, gemv.py and
few_row_mma.py, on FP8). With one row of x, x is read and quantized as a vector, then spread to
the MMA's 16 columns, so the padding costs no loads (the engine keeps one row on gemv, faster
there: benchmarks/RESULTS.md).

The quantization is the prefill's (fp8_gemm.quantize_activations): q = clamp(x / s, +-448) cast
to E4M3, s = amax / 448 (1.0 for an all-zero row or group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tokenmill.kernels._common import (
    E4M3_MAX,
    FP8_DTYPE,
    and_flag,
    dependent_launch,
    interpreting,
    mm,
    round_to_e4m3_grid,
    sm_count,
)
from tokenmill.kernels.gemv import GemvTile

MMA_ROWS = 16
GROUP = 128  # the block FP8 scale group along K (weights and activations)


def w8a8_few_row_tile(n: int, k: int, blocks: bool) -> GemvTile:
    """(BLOCK_N, BLOCK_K, warps, stages): 128-row programs, 256-column strips, the best of a sweep
    at 4 and 16 rows (benchmarks/RESULTS.md); the block layout's strips are its 128-column groups.
    Where N gives few programs, split-K (w8a8_splits) fills the machine."""
    if interpreting():
        return GemvTile(16, 32 if not blocks else GROUP, 1, 1)
    return GemvTile(128, GROUP if blocks else 256, 4, 4)


def w8a8_splits(n: int, k: int, tile: GemvTile, sms: int) -> int:
    """K splits so that a program runs on every multiprocessor, each over at least 4 strips; of
    those counts, the largest that divides the strips evenly (every split then reads whole strips
    with no K mask)."""
    strips = triton.cdiv(k, tile.block_k)
    wanted = max(1, min(strips // 4, triton.cdiv(sms, triton.cdiv(n, tile.block_n))))
    return next((s for s in range(wanted, 0, -1) if strips % s == 0), 1) if k % tile.block_k == 0 else wanted


@triton.jit
def _quantized_strip(x_ptr, stride_xm, k0, offs_k, offs_m, m_ok, K, row_scale, GROUPED: tl.constexpr,
                     ONE_ROW: tl.constexpr, EVEN_K: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """(q^T [BLOCK_K, BLOCK_M] as E4M3, x's scale [BLOCK_M]) of x's strip at k0: the strip's own
    scale when GROUPED, else row_scale."""
    k_ok = (k0 + offs_k < K) | EVEN_K
    if ONE_ROW:
        v = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if GROUPED:
            top = tl.max(tl.abs(v), 0)
            s = tl.where(top > 0, top / E4M3_MAX, 1.0)
        else:
            s = tl.max(row_scale, 0)
        q = tl.minimum(tl.maximum(v / s, -E4M3_MAX), E4M3_MAX)
        if EMULATE_ROUNDING:
            q = round_to_e4m3_grid(q)
        # Spread to the MMA's 16 columns as bytes, K fastest: the strip x's row is copied into.
        codes = q.to(tl.float8e4nv).to(tl.int8, bitcast=True)
        padded = tl.where(offs_m[:, None] == 0, codes[None, :], 0).to(tl.int8)
        q8 = tl.trans(padded.to(tl.float8e4nv, bitcast=True))
        scale = tl.where(offs_m == 0, s, 0.0)
    else:
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k0 + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if GROUPED:
            top = tl.max(tl.abs(x), 1)
            scale = tl.where(top > 0, top / E4M3_MAX, 1.0)
        else:
            scale = row_scale
        q = tl.minimum(tl.maximum(x / scale[:, None], -E4M3_MAX), E4M3_MAX)
        if EMULATE_ROUNDING:
            q = round_to_e4m3_grid(q)
        q8 = tl.trans(q.to(tl.float8e4nv))
    return q8, scale


@triton.jit
def _row_scales(x_ptr, stride_xm, offs_m, m_ok, K, BLOCK_K: tl.constexpr, ONE_ROW: tl.constexpr):
    """amax / 448 of each row of x over all K ([BLOCK_M]; 1.0 for an all-zero row)."""
    offs_k = tl.arange(0, BLOCK_K)
    if ONE_ROW:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        top = tl.max(amax, 0) + tl.zeros([offs_m.shape[0]], tl.float32)
    else:
        amax = tl.zeros([offs_m.shape[0], BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k0 + offs_k[None, :],
                        mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        top = tl.max(amax, 1)
    return tl.where(top > 0, top / E4M3_MAX, 1.0)


@triton.jit
def _finish(acc, ws_rows, bias_ptr, y_ptr, stride_ym, offs_n, n_ok, offs_m, m_ok, row_scale, GROUPED: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    if not GROUPED:
        acc = acc * tl.load(ws_rows, mask=n_ok, other=0.0)[:, None] * row_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _w8a8_few_row_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    stride_ym, stride_sn,
    GROUPED: tl.constexpr, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, ONE_ROW: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr, EMULATE_ROUNDING: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(1) * k_per_split
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    ws_rows = ws_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if PDL:
        gdc_wait()
    row_scale = tl.zeros([BLOCK_M], tl.float32)
    if not GROUPED:
        row_scale = _row_scales(x_ptr, stride_xm, offs_m, m_ok, K, BLOCK_K, ONE_ROW)
    for k_step in range(0, k_per_split, BLOCK_K):
        k0 = k_start + k_step
        if EVEN_K:
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        qt, x_scale = _quantized_strip(x_ptr, stride_xm, k0, offs_k, offs_m, m_ok, K, row_scale, GROUPED, ONE_ROW,
                                       EVEN_K, EMULATE_ROUNDING)
        if GROUPED:
            ws = tl.load(ws_rows + k0 // BLOCK_K, mask=and_flag(n_ok, k0 < K), other=0.0)
            part = mm(w, qt, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST, False)
            acc += part * ws[:, None] * x_scale[None, :]
        else:
            acc = mm(w, qt, acc, UPCAST, False)
    if SPLITS == 1:
        _finish(acc, ws_rows, bias_ptr, y_ptr, stride_ym, offs_n, n_ok, offs_m, m_ok, row_scale, GROUPED, HAS_BIAS)
    else:
        # Serial split-K: every split stores its partial sum; the last to arrive (the tile's counter)
        # adds them in split order (deterministic whatever the arrival order) and resets the counter.
        ok = n_ok[:, None] & m_ok[None, :]
        part_ptrs = part_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptrs + tl.program_id(1).to(tl.int64) * M * N, acc, mask=ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for split in range(SPLITS):
                total += tl.load(part_ptrs + split * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _finish(total, ws_rows, bias_ptr, y_ptr, stride_ym, offs_n, n_ok, offs_m, m_ok, row_scale, GROUPED,
                    HAS_BIAS)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that every split-K launch leaves zeroed: kept per
    device (made outside graph capture, so a captured launch reuses them); inside a capture that has
    none large enough, fresh ones (a memset in the graph). Shared by every launch on the device,
    which the engine issues on one stream at a time."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def w8a8_few_row(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int | None = None,
    bias: torch.Tensor | None = None, tile: GemvTile | None = None, pdl: bool | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] (16-bit float) @ W.T (+ bias) -> [M, N] in x's dtype. W = weight [N, K] E4M3
    times scale: float32 [N] (one per row; x quantized per token) or, with scale_rows, a float32
    grid [ceil(N / scale_rows), ceil(K / 128)] of 128-column blocks (x per token per 128 columns)."""
    n, k = weight.shape
    rows = x.shape[0]
    if weight.dtype != FP8_DTYPE or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w8a8_few_row takes an E4M3 weight and 16-bit x, got {weight.dtype} and {x.dtype}")
    if x.dim() != 2 or not 1 <= rows <= MMA_ROWS or x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"w8a8_few_row takes x [M <= {MMA_ROWS}, K] and a row-major weight [N, K]; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    grouped = scale_rows is not None
    expected = (triton.cdiv(n, scale_rows), triton.cdiv(k, GROUP)) if grouped else (n,)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(f"scales of a [{n}, {k}] weight must be float32 {expected}, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    tile = tile or w8a8_few_row_tile(n, k, grouped)
    if grouped and tile.block_k != GROUP:
        raise ValueError(f"block scales need {GROUP}-column strips, got {tile.block_k}")
    splits = splits or w8a8_splits(n, k, tile, sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile.block_k) * tile.block_k
    splits = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, tile.block_n)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(splits if splits > 1 else 0, rows, n, dtype=torch.float32, device=x.device)
    counters = split_counters(x.device, tiles) if splits > 1 else partials
    pdl = dependent_launch(x.device) if pdl is None else pdl
    _w8a8_few_row_kernel[(tiles, splits)](
        x, weight, scale, bias if bias is not None else scale, y, partials, counters, rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), scale.stride(0) if grouped else 1,
        GROUPED=grouped, SCALE_ROWS=scale_rows or 1, HAS_BIAS=bias is not None, BLOCK_M=MMA_ROWS,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLITS=splits, ONE_ROW=rows == 1,
        EVEN_K=k == splits * k_per_split, PDL=pdl,
        EMULATE_ROUNDING=interpreting(), UPCAST=interpreting(), num_warps=tile.num_warps,
        num_stages=tile.num_stages, launch_pdl=pdl,
    )
    return y

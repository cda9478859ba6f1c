"""Small shared helpers for the Triton kernels (this module imports triton)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from tokenmill.numerics import FP8_E4M3 as FP8_DTYPE
from tokenmill.numerics import FP8_E4M3_MAX

__all__ = ["E4M3_MAX", "FP8_DTYPE", "FP8_E4M3_MAX"]

E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
"""FP8_E4M3_MAX for jitted code, which reads a module global only when it is a constexpr."""


def interpreting() -> bool:
    """True when kernels run under TRITON_INTERPRET=1 (CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def dot_width(n: int) -> int:
    """A block width that a tl.dot reduces over: a power of two of at least 16 (the GPU's MMAs
    take no narrower K; the padding columns are masked to zero)."""
    return max(16, next_pow2(n))


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small stand-in on CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (sm_90+): a kernel may start while the one before it
    finishes, doing work that does not read its output until `gdc_wait`. Never in the interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@triton.jit
def launch_next(ENABLED: tl.constexpr):
    """Let the next kernel, if launched as a programmatic dependent (the few-row matmul after a
    norm, attention or SiLU), start now: it reads only weights until it waits for this one."""
    if ENABLED:
        gdc_launch_dependents()


@triton.jit
def mm(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b. UPCAST: the interpreter multiplies bfloat16 as raw integers, so widen first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def round_to_e4m3_grid(x):
    """x (float32, within +-448) rounded to the nearest FP8 E4M3 value, ties to even, still in
    float32. Only for the interpreter, whose float32 -> float8 cast neither carries a rounded-up
    mantissa into the exponent nor rounds ties to even; on the GPU the cast itself is exact."""
    a = tl.abs(x)
    exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 2e-3))), -6.0)  # below 2**-6: subnormal
    ulp = tl.exp2(exponent - 3.0)
    # Adding and removing 2**23 rounds a float32 below 2**22 to an integer, ties to even.
    steps = (a / ulp + 8388608.0) - 8388608.0
    return tl.where(x < 0, -steps * ulp, tl.where(x == 0, x, steps * ulp))  # keeps -0.0


@triton.jit
def and_flag(mask, flag):
    """mask & flag for a per-program scalar flag (a loaded boolean or comparison): the
    interpreter refuses a load mask broadcast from a scalar, so spread the flag first."""
    return mask & ((mask.to(tl.int32) * 0 + flag.to(tl.int32)) != 0)


@triton.jit
def e8m0_to_f32(code):
    """E8M0 codes (uint8) as float32 2^(code - 127), built from the exponent bits (exact; code 0 is
    the subnormal 2^-127)."""
    bits = code.to(tl.int32) << 23
    return tl.where(code == 0, 5.877471754111438e-39, bits.to(tl.float32, bitcast=True))


@triton.jit
def block_scales(scale_ptr, offs_n, n_ok, k0, K, stride_sn, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                 BLOCK_K: tl.constexpr, E8M0: tl.constexpr):
    """The float32 scales of a weight strip [BLOCK_N rows offs_n, columns k0 : k0 + BLOCK_K] from a
    scale grid (row n // SCALE_ROWS, column k // SCALE_COLS, row stride stride_sn): [BLOCK_N] when
    the strip lies in one column group (SCALE_COLS >= BLOCK_K), else [BLOCK_N, BLOCK_K // SCALE_COLS]."""
    rows = (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    if SCALE_COLS >= BLOCK_K:
        s = tl.load(scale_ptr + rows + k0 // SCALE_COLS, mask=n_ok, other=0)
    else:
        groups = k0 // SCALE_COLS + tl.arange(0, BLOCK_K // SCALE_COLS)
        s = tl.load(scale_ptr + rows[:, None] + groups[None, :], mask=n_ok[:, None] & (groups * SCALE_COLS < K)[None, :],
                    other=0)
    if E8M0:
        s = e8m0_to_f32(s)
    else:
        s = s.to(tl.float32)
    return s


@triton.jit
def apply_block_scales(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_COLS: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] (float32) times its block_scales s. (Jitted helpers branch on constexprs
    with if / else and return once: code after an early return is compiled for every variant.)"""
    if SCALE_COLS >= BLOCK_K:
        w = w * s[:, None]
    else:
        w3 = tl.reshape(w, (BLOCK_N, BLOCK_K // SCALE_COLS, SCALE_COLS))
        w = tl.reshape(w3 * s[:, :, None], (BLOCK_N, BLOCK_K))
    return w


def scale_launch(weight: torch.Tensor, weight_scale: torch.Tensor | None, scale_block: tuple[int, int] | None,
                 block_k: int) -> dict:
    """The scale constexprs of a weight-streaming launch: SCALE_ROWS, SCALE_COLS (0: one scale per
    row, applied to the sum; else per strip or per column group, applied to the weight), E8M0; a
    column group must hold whole strips or whole groups fit in a strip (both powers of two)."""
    rows, cols = scale_block or (1, 0)
    if cols and max(cols, block_k) % min(cols, block_k):
        raise ValueError(f"scale groups of {cols} columns and strips of {block_k} do not nest")
    stride = weight_scale.stride(-2) if weight_scale is not None and weight_scale.dim() >= 2 else 1
    return dict(stride_sn=stride, SCALE_ROWS=rows, SCALE_COLS=cols,
                E8M0=weight_scale is not None and weight_scale.dtype == torch.uint8)

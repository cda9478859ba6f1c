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

__all__ = ["FP8_DTYPE", "FP8_E4M3_MAX"]


def interpreting() -> bool:
    """True when kernels run under TRITON_INTERPRET=1 (CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


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

"""llama.cpp's legacy block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) dequantized with torch, in a
few whole-tensor operations: several times faster than gguf.quants' numpy (which works in groups
of rows), and bitwise the same floats (the same float32 products and sums, in gguf's order;
tests/models/test_gguf_dequant.py compares them). Other types go through gguf.quants.

Each block holds 32 weights: an f16 scale d (and for the _1 types an f16 minimum m), for the
5-bit types 32 high bits in one little-endian u32, then the quants; 4-bit quants pack weight j
in the low nibble of byte j and weight j + 16 in its high nibble.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

_Q = GGMLQuantizationType
_BITS = torch.arange(32, dtype=torch.int32)


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    return torch.frombuffer(np.ascontiguousarray(raw).data, dtype=torch.uint8).view(-1, block_bytes)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    return torch.cat([quants & 0x0F, quants >> 4], dim=1)


def _high_bits(blocks: torch.Tensor, at: int) -> torch.Tensor:
    word = blocks[:, at:at + 4].contiguous().view(torch.int32)  # little-endian u32, as int32 bits
    return (((word >> _BITS) & 1) << 4).to(torch.uint8)


def dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 34)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(blocks, 0))


def dequantize_q4_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 18)
    return _nibbles(blocks[:, 2:]).float().sub_(8).mul_(_f16(blocks, 0))


def dequantize_q4_1(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 20)
    return _nibbles(blocks[:, 4:]).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def dequantize_q5_0(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 22)
    quants = _nibbles(blocks[:, 6:]) | _high_bits(blocks, 2)
    return quants.float().sub_(16).mul_(_f16(blocks, 0))


def dequantize_q5_1(raw: np.ndarray) -> torch.Tensor:
    blocks = _blocks(raw, 24)
    quants = _nibbles(blocks[:, 8:]) | _high_bits(blocks, 4)
    return quants.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


# Flat float32 weights from a tensor's raw blocks (gguf's byte-shaped data); reshape to the tensor.
FAST_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], torch.Tensor]] = {
    _Q.Q8_0: dequantize_q8_0, _Q.Q4_0: dequantize_q4_0, _Q.Q4_1: dequantize_q4_1,
    _Q.Q5_0: dequantize_q5_0, _Q.Q5_1: dequantize_q5_1,
}

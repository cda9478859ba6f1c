"""The torch dequantizers of llama.cpp's legacy block formats give bitwise gguf.quants' floats,
on random blocks (every scale, minimum and quant pattern) and on blocks gguf quantized itself."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tokenmill.models.gguf_dequant import FAST_DEQUANTIZERS


@pytest.mark.parametrize("qtype", sorted(FAST_DEQUANTIZERS, key=lambda q: q.name), ids=lambda q: q.name)
def test_random_blocks_dequantize_as_gguf_does(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 6, 4
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    scales = raw.reshape(rows, blocks_per_row, block_bytes)
    halves = 2 if qtype in (Q.Q4_1, Q.Q5_1) else 1  # d, and m for the _1 types: finite f16 values
    scales[:, :, :2 * halves] = rng.standard_normal((rows, blocks_per_row, halves)).astype(np.float16).view(np.uint8)
    theirs = gguf.quants.dequantize(raw, qtype)
    ours = FAST_DEQUANTIZERS[qtype](raw).reshape(theirs.shape)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_quantized_weights_round_trip_as_gguf_reads_them(qtype: Q) -> None:
    weights = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    theirs = gguf.quants.dequantize(raw, qtype)
    ours = FAST_DEQUANTIZERS[qtype](raw).reshape(theirs.shape).numpy()
    assert np.array_equal(ours, theirs)
    assert np.abs(ours - weights).max() < 0.25  # and it is the weights, not noise

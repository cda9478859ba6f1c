"""Q4_K and Q6_K: gguf cannot quantize them, so random blocks are checked against ggml's C code."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill.models.gguf_file import unpermute_rotary
from tokenmill.models.loader import iter_weights, resolve_model


def ref_dequant_q4_k(block: bytes) -> list[float]:
    """ggml-quants.c dequantize_row_q4_K (with get_scale_min_k4), one 144-byte block."""
    d = float(np.frombuffer(block[0:2], np.float16)[0])
    dmin = float(np.frombuffer(block[2:4], np.float16)[0])
    scales, qs = block[4:16], block[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out: list[float] = []
    for n, j in enumerate(range(0, 256, 64)):
        q = qs[32 * n: 32 * n + 32]
        sc1, m1 = scale_min(2 * n)
        sc2, m2 = scale_min(2 * n + 1)
        out += [np.float32(d * sc1) * (b & 0xF) - np.float32(dmin * m1) for b in q]
        out += [np.float32(d * sc2) * (b >> 4) - np.float32(dmin * m2) for b in q]
    return out


def ref_dequant_q6_k(block: bytes) -> list[float]:
    """ggml-quants.c dequantize_row_q6_K, one 210-byte block."""
    ql, qh = block[0:128], block[128:192]
    sc = np.frombuffer(block[192:208], np.int8)
    d = float(np.frombuffer(block[208:210], np.float16)[0])
    y = [0.0] * 256
    for half in range(2):
        L, H, S, Y = 64 * half, 32 * half, 8 * half, 128 * half
        for j in range(32):
            i = j // 16
            q1 = ((ql[L + j] & 0xF) | (((qh[H + j] >> 0) & 3) << 4)) - 32
            q2 = ((ql[L + j + 32] & 0xF) | (((qh[H + j] >> 2) & 3) << 4)) - 32
            q3 = ((ql[L + j] >> 4) | (((qh[H + j] >> 4) & 3) << 4)) - 32
            q4 = ((ql[L + j + 32] >> 4) | (((qh[H + j] >> 6) & 3) << 4)) - 32
            y[Y + j] = d * sc[S + i] * q1
            y[Y + j + 32] = d * sc[S + i + 2] * q2
            y[Y + j + 64] = d * sc[S + i + 4] * q3
            y[Y + j + 96] = d * sc[S + i + 6] * q4
    return y


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a [rows, cols] tensor: random bits, finite fp16 super-block scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scale = rng.uniform(1e-3, 2e-2, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        blocks[:, 0:4] = scale  # d, dmin
    else:
        blocks[:, 208:210] = scale[:, 0:2]  # d
    return blocks.reshape(rows, cols // block_size * type_size)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_dequant_matches_ggml_reference(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(0)
    ref = ref_dequant_q4_k if qtype == Q.Q4_K else ref_dequant_q6_k
    n_head, rows, cols = 2, 32, 512  # attn_q: [n_head * head_dim, hidden], permuted like llama
    q_bytes, down_bytes = random_k_blocks(qtype, rows, cols, rng), random_k_blocks(qtype, 64, 256, rng)
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_block_count(1)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_tensor("blk.0.attn_q.weight", q_bytes, raw_dtype=qtype)
    writer.add_tensor("blk.0.ffn_down.weight", down_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = dict(iter_weights(resolve_model(tmp_path / "k.gguf")))

    def reference(data: np.ndarray) -> np.ndarray:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        flat = data.reshape(-1, type_size)
        return np.array([ref(flat[i].tobytes()) for i in range(flat.shape[0])], np.float32).reshape(data.shape[0], -1)

    want_q = unpermute_rotary(torch.from_numpy(reference(q_bytes)), n_head)
    torch.testing.assert_close(got["model.layers.0.self_attn.q_proj.weight"], want_q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(reference(down_bytes)),
                               rtol=1e-6, atol=1e-7)

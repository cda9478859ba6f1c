"""The QSA layer on its Triton backend (the interpreter on CPU) against transformers over whole
sequences: requests packed and chunked (blocks closing inside and across chunks), decode with
split attention, and an FP8 K/V cache."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu
from qwen4exp_cases import ChunkedRun, build_qsa, qsa_reference, run_qsa_chunked, tiny_config

from tokenmill.layers.attention.qsa_backends import TritonQSABackend


@pytest.mark.parametrize("kv_dtype, splits, chunks, tolerance, device", [
    on_cpu(torch.float32, None, (4, 1, 9), 1e-5, id="fp32-chunked"),
    on_cpu(torch.float32, 2, (1,), 1e-5, id="fp32-decode-split"),
    on_cpu(torch.float8_e4m3fn, None, (6, 1), 0.08, id="fp8-kv"),
])
def test_triton_layer_matches_transformers(kv_dtype, splits, chunks, tolerance, device) -> None:
    config = tiny_config(indexer_budget=8, indexer_compress_ratio=4)
    theirs, ours = build_qsa(config, 8, TritonQSABackend(num_splits=splits), cache_dtype=kv_dtype)
    if kv_dtype == torch.float8_e4m3fn:
        ours.kv_scales = (0.05, 0.05)
    lengths = [5, 23, 1, 14]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, config.hidden_size, generator=gen) for n in lengths]
    got = run_qsa_chunked(ours, ChunkedRun(lengths, 8, chunks), inputs)
    for r, x in enumerate(inputs):
        ref = qsa_reference(theirs, config, x)
        error = ((got[r] - ref).abs().max() / ref.abs().max()).item()
        assert error < tolerance, f"request {r}: relative error {error}"

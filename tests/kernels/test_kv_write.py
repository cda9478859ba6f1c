"""The KV-cache write kernel: model-dtype and FP8 caches, strided inputs, skipped padding slots."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.kv_cache import FP8_DTYPE, write_kv_cache, write_kv_cache_ref


@pytest.mark.parametrize(
    "tokens,kv_heads,head_dim,cache_dtype,scales,device",
    [
        on_cpu(9, 2, 64, torch.float32, (1.0, 1.0), id="f32"),
        on_cpu(9, 3, 128, torch.bfloat16, (1.0, 1.0), id="bf16"),
        on_cpu(9, 2, 64, FP8_DTYPE, (0.05, 3.0), id="fp8"),
        on_gpu(2048, 8, 128, torch.bfloat16, (1.0, 1.0), id="llama-bf16"),
        on_gpu(2048, 8, 128, FP8_DTYPE, (0.02, 0.5), id="llama-fp8"),
        on_gpu(64, 4, 256, FP8_DTYPE, (1.0, 1.0), id="d256-fp8"),
    ],
)
def test_write_matches_reference(tokens, kv_heads, head_dim, cache_dtype, scales, device) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cache_dtype == FP8_DTYPE else cache_dtype
    block_size, num_blocks = 16, tokens // 16 + 4
    kv = 4 * torch.randn(tokens, 2 * kv_heads * head_dim + 8, device=device, dtype=dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)  # strided views
    value = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[1] = -1  # a padded token: nothing written
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.float32)
    cache = cache.to(cache_dtype)
    expected = cache.clone()
    write_kv_cache(key, value, cache, slots, *scales)
    write_kv_cache_ref(key, value, expected, slots, *scales)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.count_nonzero(cache.view(torch.uint8)) > 0


@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_write_matches_the_torch_backend(device) -> None:
    """Byte for byte what the reference backend writes (on CPU, where it divides exactly)."""
    from tokenmill.layers.attention.torch_ref import write_kv

    torch.manual_seed(1)
    key, value = 20 * torch.randn(2, 12, 2, 64, dtype=torch.bfloat16)
    slots = torch.randperm(64)[:12]
    for cache_dtype, scales in ((FP8_DTYPE, (0.05, 3.0)), (torch.bfloat16, (1.0, 1.0))):
        ours = torch.zeros(2, 4, 16, 2, 64).to(cache_dtype)
        theirs = ours.clone()
        write_kv_cache(key, value, ours, slots, *scales)
        write_kv(theirs, key, value, slots, *scales)
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))

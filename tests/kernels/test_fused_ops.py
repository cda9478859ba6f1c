"""RMSNorm (+ residual), SiLU-and-mul and rotary kernels against their PyTorch references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref
from tokenmill.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tokenmill.kernels.rotary import apply_rotary_, apply_rotary_ref
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import _rotate

# The interpreter truncates float32 -> bfloat16, so allow a bfloat16 ulp or two.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOL[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "tokens,hidden,dtype,device",
    [
        on_cpu(3, 64, torch.float32, id="tiny-f32"),
        on_cpu(5, 96, torch.bfloat16, id="tiny-odd-bf16"),
        on_gpu(1, 4096, torch.bfloat16, id="llama-decode"),
        on_gpu(2048, 4096, torch.bfloat16, id="llama-prefill"),
        on_gpu(333, 5120, torch.float16, id="f16"),
    ],
)
def test_rms_norm(tokens, hidden, dtype, device) -> None:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    close(new_residual, ref_residual)
    close(normed, ref_normed)


def test_rms_norm_reference_is_the_layer() -> None:
    layer = RMSNorm(32, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(x), rms_norm_ref(x, layer.weight.detach(), 1e-6))


@pytest.mark.parametrize(
    "tokens,inter,dtype,device",
    [
        on_cpu(3, 40, torch.float32, id="tiny-f32"),
        on_cpu(2, 64, torch.bfloat16, id="tiny-bf16"),
        on_gpu(1, 14336, torch.bfloat16, id="llama-decode"),
        on_gpu(2048, 14336, torch.bfloat16, id="llama-prefill"),
    ],
)
def test_silu_and_mul(tokens, inter, dtype, device) -> None:
    torch.manual_seed(0)
    x = 3 * torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    block = 16 if device == "cpu" else 1024  # several column blocks even at tiny sizes
    close(silu_and_mul(x, block=block), silu_and_mul_ref(x))


def rope_cache(max_pos: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(device), emb.sin().to(device)


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, device, dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model gives them: strided [T, heads, D] views into one projection output."""
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=device, dtype=dtype)
    return qkv.split([heads, kv_heads, kv_heads], dim=1)


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,dtype,device",
    [
        on_cpu(4, 4, 2, 64, torch.float32, id="tiny-f32"),
        on_cpu(3, 3, 1, 128, torch.bfloat16, id="tiny-bf16"),
        on_gpu(2048, 32, 8, 128, torch.bfloat16, id="llama-prefill"),
        on_gpu(7, 16, 16, 64, torch.float16, id="d64-f16"),
        on_gpu(64, 8, 4, 256, torch.bfloat16, id="d256"),
    ],
)
def test_rotary_in_place_on_strided_views(tokens, heads, kv_heads, head_dim, dtype, device) -> None:
    torch.manual_seed(0)
    cos, sin = rope_cache(4096, head_dim, device)
    positions = torch.randint(0, 4096, (tokens,), device=device)
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, device, dtype)
    ref_q, ref_k = apply_rotary_ref(positions, q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    apply_rotary_(positions, q, k, cos, sin)
    close(q, ref_q)
    close(k, ref_k)
    assert torch.equal(v, v_before)


def test_rotary_reference_is_the_layer() -> None:
    cos, sin = rope_cache(64, 32, "cpu")
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
    ref, _ = apply_rotary_ref(positions, x, x, cos, sin)
    assert torch.equal(_rotate(x, c, s), ref)


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,cache_dtype,device",
    [
        on_cpu(3, 4, 2, 16, torch.float32, id="tiny-f32"),
        on_cpu(4, 4, 2, 12, torch.float8_e4m3fn, id="tiny-fp8-odd-half"),
        on_gpu(1, 32, 8, 128, torch.bfloat16, id="llama-decode"),
        on_gpu(64, 32, 8, 128, torch.float8_e4m3fn, id="llama-fp8"),
        on_gpu(333, 16, 4, 64, torch.bfloat16, id="head64"),
    ],
)
def test_rotate_and_cache_equals_rotary_then_kv_write(tokens, heads, kv_heads, head_dim, cache_dtype, device) -> None:
    """The fused kernel = the two kernels it replaces (apply_rotary_ then write_kv_cache, each
    tested against PyTorch above and in test_kv_write), bit for bit; a negative slot writes nothing."""
    from tokenmill.kernels.kv_cache import write_kv_cache
    from tokenmill.kernels.rotary import rotate_and_cache_

    torch.manual_seed(0)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    q, k, v = qkv_views(tokens, heads, kv_heads, head_dim, device, dtype)
    positions = torch.randint(0, 500, (tokens,), device=device)
    cos, sin = rope_cache(512, head_dim, device)
    page, blocks = 4, tokens + 2
    slots = torch.randperm(blocks * page, device=device)[:tokens]
    slots[0] = -1
    expected_cache = torch.zeros(2, blocks, page, kv_heads, head_dim, device=device).to(cache_dtype)
    actual_cache = expected_cache.clone()
    ref_q, ref_k = apply_rotary_(positions, q.clone(), k.clone(), cos, sin)
    write_kv_cache(ref_k, v, expected_cache, slots, 0.5, 2.0)
    k_before = k.clone()
    rotate_and_cache_(positions, q, k, v, cos, sin, actual_cache, slots, 0.5, 2.0)
    assert torch.equal(q, ref_q)
    assert torch.equal(k, k_before)
    assert torch.equal(actual_cache.view(torch.uint8), expected_cache.view(torch.uint8))

"""The MLA kernels against their PyTorch references (tokenmill.layers.attention.mla_ref): the latent
cache write (FP8 quantize-on-write), the absorbed decode / verification kernel (split-KV merge,
head tiles, FP8 cache, pages, graph padding, overstated host lengths) and the up-projected
prefill kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu, paged_batch
from mla_cases import SCALED_YARN
from transformers import DeepseekV3Config

from tokenmill.kernels.latent_cache import prepare_latents, write_latent_cache
from tokenmill.kernels.mla_decode import MAX_SPLITS, absorbed_attention, plan_absorbed
from tokenmill.kernels.mla_prefill import upprojected_attention
from tokenmill.layers.attention.mla_ref import (
    absorbed_attention_ref,
    prepare_latents_ref,
    quantize_latent_ref,
    upprojected_attention_ref,
    write_latent_cache_ref,
)
from tokenmill.layers.attention.mla_rotary import MLARotary

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2.5e-2}
TINY = dict(heads=4, latent=32, rope=8)
V2_LITE = dict(heads=16, latent=512, rope=64)
V3 = dict(heads=128, latent=512, rope=64)

# (query_len, seq_len) per request
DECODE_TINY = [(1, 40), (1, 1), (1, 23), (1, 64)]
VERIFY_TINY = [(5, 40), (5, 5), (17, 30), (1, 9), (3, 50)]
LONG_TINY = [(40, 40), (12, 60), (1, 7)]
DECODE_32K = [(1, 32768)]
BATCH_DECODE = [(1, n) for n in (32768, 128, 4096, 1, 16384, 777, 2048, 31000)] * 2
VERIFY_REAL = [(5, 32768), (5, 1000), (17, 4096), (1, 300)]


def random_cache(num_blocks: int, block_size: int, width: int, cache_dtype: torch.dtype, scale: float,
                 device: str) -> torch.Tensor:
    cache = torch.randn(num_blocks, block_size, width, device=device)
    return quantize_latent_ref(cache, scale) if cache_dtype == FP8 else cache.to(cache_dtype)


def check_absorbed(requests, heads: int, latent: int, rope: int, dtype: torch.dtype, device: str,
                   cache_dtype: torch.dtype | None = None, scale: float = 1.0, block_size: int = 4,
                   **plan_overrides: int):
    torch.manual_seed(0)
    batch = paged_batch(requests, block_size, device)
    md = batch.metadata
    num_tokens = sum(q for q, _ in requests)
    cache = random_cache(batch.num_blocks, block_size, latent + rope, cache_dtype or dtype, scale, device)
    q_latent = torch.randn(num_tokens, heads, latent, device=device, dtype=dtype)
    q_pe = torch.randn(num_tokens, heads, rope, device=device, dtype=dtype)
    softmax_scale = 0.5 * (latent + rope) ** -0.5
    expected = absorbed_attention_ref(q_latent.float(), q_pe.float(), cache, md, softmax_scale, scale)
    plan = plan_absorbed(num_tokens=num_tokens, num_requests=len(requests), max_query_len=md.max_query_len,
                         max_seq_len=md.max_seq_len, num_heads=heads, device=torch.device(device),
                         fp8_cache=cache.dtype == FP8, cache_bytes=cache.element_size(), **plan_overrides)
    out = absorbed_attention(q_latent, q_pe, cache, md.query_start_loc, md.seq_lens, md.block_tables, softmax_scale,
                             plan, scale)
    assert out.dtype == dtype and out.shape == q_latent.shape
    err = (out.float() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err} with {plan}"
    return plan


@pytest.mark.parametrize(
    "requests,dims,dtype,overrides,device",
    [
        on_cpu(DECODE_TINY, TINY, torch.float32, {}, id="decode-f32"),
        on_cpu(VERIFY_TINY, TINY, torch.bfloat16, {}, id="verify-bf16"),
        on_cpu(LONG_TINY, TINY, torch.float32, {}, id="long-queries-f32"),
        on_cpu(DECODE_TINY, TINY, torch.bfloat16, dict(num_splits=3), id="decode-3-splits"),
        on_cpu(VERIFY_TINY, TINY, torch.float32, dict(num_splits=5, block_h=2), id="verify-5-splits-head-tiles"),
        on_cpu(DECODE_TINY, TINY, torch.float32, dict(num_splits=16), id="decode-16-splits-mostly-empty"),
        on_cpu([(2, 20)], dict(heads=3, latent=24, rope=6), torch.float32, dict(num_splits=2), id="odd-sizes"),
        on_gpu(DECODE_32K, V2_LITE, torch.bfloat16, {}, id="v2lite-bs1-32k"),
        on_gpu(BATCH_DECODE, V2_LITE, torch.bfloat16, {}, id="v2lite-decode-batch"),
        on_gpu(VERIFY_REAL, V2_LITE, torch.bfloat16, {}, id="v2lite-verify"),
        on_gpu(DECODE_32K, V3, torch.bfloat16, {}, id="v3-bs1-32k"),
        on_gpu(VERIFY_REAL, V3, torch.bfloat16, {}, id="v3-verify"),
        on_gpu(BATCH_DECODE[:6], V2_LITE, torch.float32, {}, id="v2lite-f32"),
        on_gpu(DECODE_32K, V2_LITE, torch.bfloat16, dict(num_splits=MAX_SPLITS), id="v2lite-max-splits"),
    ],
)
def test_absorbed_matches_reference(requests, dims, dtype, overrides, device) -> None:
    block_size = 4 if device == "cpu" else 16
    plan = check_absorbed(requests, dims["heads"], dims["latent"], dims["rope"], dtype, device, block_size=block_size,
                          **overrides)
    if "num_splits" in overrides:
        assert plan.num_splits == overrides["num_splits"]


@pytest.mark.parametrize(
    "requests,dims,scale,device",
    [
        on_cpu(VERIFY_TINY, TINY, 0.25, id="tiny"),
        on_gpu(DECODE_32K + VERIFY_REAL, V2_LITE, 0.05, id="v2lite"),
        on_gpu(BATCH_DECODE, V3, 1.0, id="v3"),
    ],
)
def test_absorbed_reads_fp8_cache(requests, dims, scale, device) -> None:
    block_size = 4 if device == "cpu" else 64
    check_absorbed(requests, dims["heads"], dims["latent"], dims["rope"], torch.bfloat16, device, cache_dtype=FP8,
                   scale=scale, block_size=block_size, **({"num_splits": 3} if device == "cpu" else {}))


@pytest.mark.parametrize("block_size,device", [on_cpu(16, id="page16-cpu"), on_gpu(64, id="page64-cuda")])
def test_absorbed_pages_larger_than_a_tile(block_size, device) -> None:
    dims = TINY if device == "cpu" else V2_LITE
    check_absorbed([(1, 70), (4, 33)], dims["heads"], dims["latent"], dims["rope"], torch.float32, device,
                   block_size=block_size)


@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_absorbed_graph_padding_and_overstated_lengths(num_splits, device) -> None:
    """A captured graph's batch: rows past every request are neither read nor written, and a
    plan made from max_model_len host lengths stays exact on the true device lengths."""
    torch.manual_seed(0)
    md = paged_batch([(1, 20), (1, 5)], 4, device).metadata
    cache = torch.randn(12, 4, 40)
    q_latent, q_pe = torch.randn(4, 4, 32), torch.randn(4, 4, 8)
    out = torch.full((4, 4, 32), 7.0)
    plan = plan_absorbed(num_tokens=4, num_requests=2, max_query_len=1, max_seq_len=4096, num_heads=4,
                         device=torch.device(device), num_splits=num_splits)
    assert plan.num_splits == (num_splits or 2)  # 2 x 4 programs per interpreter "SM" over 4 rows
    absorbed_attention(q_latent, q_pe, cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.2, plan, out=out)
    expected = absorbed_attention_ref(q_latent, q_pe, cache, md, 0.2)
    assert (out[:2] - expected[:2]).abs().max().item() < TOLERANCE[torch.float32]
    assert torch.equal(out[2:], torch.full((2, 4, 32), 7.0))


@pytest.mark.parametrize(
    "cache_dtype,scale,width,block_size,device",
    [
        on_cpu(torch.float32, 1.0, (32, 8), 4, id="f32"),
        on_cpu(torch.bfloat16, 1.0, (24, 6), 4, id="bf16-odd-sizes"),
        on_cpu(FP8, 0.37, (32, 8), 4, id="fp8"),
        on_gpu(torch.bfloat16, 1.0, (512, 64), 16, id="bf16-576"),
        on_gpu(FP8, 0.05, (512, 64), 64, id="fp8-576"),
    ],
)
def test_latent_write_matches_reference(cache_dtype, scale, width, block_size, device) -> None:
    """Strided views of one projection's output, some padded slots (-1), a cache that already holds data."""
    torch.manual_seed(0)
    latent_dim, rope_dim = width
    num_tokens, num_blocks = 37, 16
    projected = torch.randn(num_tokens, latent_dim + rope_dim + 5, device=device) * 3
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    projected = projected.to(dtype)
    latent, k_pe = projected[:, :latent_dim], projected[:, latent_dim : latent_dim + rope_dim]
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[[3, 10]] = -1
    cache = random_cache(num_blocks, block_size, latent_dim + rope_dim, cache_dtype, scale, device)
    expected = cache.clone()
    write_latent_cache_ref(latent, k_pe, expected, slots, scale)
    write_latent_cache(latent, k_pe, cache, slots, scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(cache.view(torch.uint8), random_cache(num_blocks, block_size, latent_dim + rope_dim,
                                                                 cache_dtype, scale, device).view(torch.uint8))


@pytest.mark.parametrize(
    "requests,dims,dtype,device",
    [
        on_cpu([(20, 40), (5, 5), (1, 9), (33, 33)], (3, 16, 8, 12), torch.float32, id="mixed-f32"),
        on_cpu([(18, 50), (24, 24)], (2, 16, 8, 16), torch.bfloat16, id="prefix-bf16"),
        on_gpu([(2048, 2048)], (16, 128, 64, 128), torch.bfloat16, id="v2lite-2048"),
        on_gpu([(512, 8704), (1000, 1000), (37, 300)], (16, 128, 64, 128), torch.bfloat16, id="v2lite-chunked"),
        on_gpu([(300, 700)], (128, 128, 64, 128), torch.float32, id="v3-f32"),
    ],
)
def test_upprojected_prefill_matches_reference(requests, dims, dtype, device) -> None:
    torch.manual_seed(0)
    heads, nope, rope, vdim = dims
    md = paged_batch(requests, 16, device).metadata
    num_tokens, context = sum(q for q, _ in requests), sum(s for _, s in requests)
    q = torch.randn(num_tokens, heads, nope + rope, device=device, dtype=dtype)
    kv = torch.randn(context, heads, nope + vdim, device=device, dtype=dtype)
    k_pe = torch.randn(context, rope, device=device, dtype=dtype)
    scale = (nope + rope) ** -0.5
    expected = upprojected_attention_ref(q, kv[..., :nope], k_pe, kv[..., nope:], md, scale)
    kv_starts = torch.cumsum(md.seq_lens, 0) - md.seq_lens
    out = upprojected_attention(q[..., :nope], q[..., nope:], kv[..., :nope], k_pe, kv[..., nope:], md.query_start_loc,
                                kv_starts, md.seq_lens, scale)
    assert out.shape == (num_tokens, heads, vdim) and out.dtype == dtype
    assert (out.float() - expected).abs().max().item() < TOLERANCE[dtype]


# Relative size of one unit in the last place of each dtype: the fused kernel's norm sums in
# another order and its cos / sin are the device's, so a value may round one ulp apart (of the
# rotated pair's inputs, which are O(1) here, when the rotation cancels).
ULP = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, FP8: 2.0**-3}


@pytest.mark.parametrize(
    "rope,dims,dtype,cache_dtype,device",
    [
        on_cpu("interleaved", (4, 16, 32, 8), torch.float32, torch.float32, id="interleaved-f32"),
        on_cpu("neox", (3, 16, 32, 8), torch.bfloat16, torch.bfloat16, id="neox-bf16"),
        on_cpu(None, (4, 16, 32, 8), torch.bfloat16, FP8, id="nope-fp8"),
        on_cpu("interleaved", (4, 16, 32, 8), torch.bfloat16, FP8, id="interleaved-fp8"),
        on_gpu("interleaved", (16, 128, 512, 64), torch.bfloat16, torch.bfloat16, id="v2lite-bf16"),
        on_gpu("interleaved", (128, 128, 512, 64), torch.bfloat16, FP8, id="v3-fp8"),
        on_gpu(None, (32, 128, 512, 64), torch.bfloat16, FP8, id="kimi-fp8"),
    ],
)
def test_fused_prepare_matches_reference(rope, dims, dtype, cache_dtype, device) -> None:
    """Norm + rotation of q_pe (in place) and k_pe + cache write in one kernel, against the
    PyTorch composition; far positions (YaRN-scaled frequencies, attention factor != 1)."""
    heads, nope, latent_dim, rope_dim = dims
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=heads, qk_rope_head_dim=rope_dim,
                              max_position_embeddings=163840,
                              rope_parameters=dict(SCALED_YARN, original_max_position_embeddings=4096))
    rotary = MLARotary(config, rope_dim, rope).to(device) if rope else None
    torch.manual_seed(0)
    num_tokens, num_blocks, block_size = 29, 12, 4
    positions = torch.randint(0, 160000, (num_tokens,), device=device)
    q = torch.randn(num_tokens, heads * (nope + rope_dim), device=device).to(dtype).view(num_tokens, heads, -1)
    compressed = (torch.randn(num_tokens, latent_dim + rope_dim, device=device) * 2).to(dtype)
    weight = (1 + 0.3 * torch.randn(latent_dim, device=device)).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[[0, 7]] = -1
    scale = 0.02 if cache_dtype == FP8 else 1.0
    cache = random_cache(num_blocks, block_size, latent_dim + rope_dim, cache_dtype, scale, device)
    expected_cache, expected_q, q_in = cache.clone(), q.clone(), q.clone()
    prepare_latents_ref(positions, expected_q, compressed, weight, 1e-6, rotary, expected_cache, slots, scale)
    prepare_latents(positions, q, compressed, weight, 1e-6, None if rotary is None else rotary.inv_freq,
                    rotary.attention_factor if rotary else 1.0, rope == "interleaved", cache, slots, scale)
    assert torch.allclose(q.float(), expected_q.float(), rtol=ULP[dtype], atol=4 * ULP[dtype])
    if rope is None:
        assert torch.equal(q, expected_q)
    deq, expected_deq = (c.float() * (scale if cache_dtype == FP8 else 1.0) for c in (cache, expected_cache))
    assert torch.allclose(deq, expected_deq, rtol=ULP[cache_dtype], atol=4 * ULP[cache_dtype])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache.view(-1, cache.shape[-1])[untouched].view(torch.uint8),
                       expected_cache.view(-1, cache.shape[-1])[untouched].view(torch.uint8))
    if rope is not None:  # the rotation happened (the reference's q differs from the input's)
        assert (expected_q.float() - q_in.float()).abs().max() > 0.5

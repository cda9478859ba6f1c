"""The Triton attention backend against the torch reference backend: prefill, chunked prefill,
decode with and without KV splits, mixed batches, GQA, head sizes, FP8 KV, strided inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import INTERPRETING, PagedBatch, on_cpu, on_gpu, paged_batch

from tokenmill.kernels.attention import MAX_SPLITS, paged_attention, plan_attention
from tokenmill.kernels.kv_cache import quantize_fp8_ref, write_kv_cache_ref
from tokenmill.layers.attention.torch_ref import TorchReferenceBackend
from tokenmill.layers.attention.triton_backend import FP8_KV_DTYPE, TritonAttentionBackend

FP8 = FP8_KV_DTYPE
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}

# (query_len, seq_len) per request
MIXED_TINY = [(5, 5), (1, 40), (7, 30), (1, 200), (1, 17), (16, 16)]
DECODE_TINY = [(1, 200), (1, 33), (1, 1), (1, 64)]
LLAMA_MIXED = [(2048, 2048), (512, 4608), (1, 32768), (1, 1000), (1, 4097), (37, 300)]
LLAMA_DECODE = [(1, n) for n in (32768, 128, 4096, 1, 16384, 777)] * 4


def random_cache(
    shape: tuple[int, ...], kv_dtype: torch.dtype, dtype: torch.dtype, scales: tuple[float, float], device
) -> torch.Tensor:
    cache = torch.randn(shape, dtype=torch.float32, device=device)
    if kv_dtype == FP8:  # dequantizes to about N(0, 1), as fresh keys and values are
        return torch.stack([quantize_fp8_ref(cache[i], s) for i, s in enumerate(scales)])
    return cache.to(dtype)


def dequantized(cache: torch.Tensor, scales: tuple[float, float]) -> torch.Tensor:
    if cache.dtype != FP8:
        return cache.float()
    return torch.stack([cache[i].float() * s for i, s in enumerate(scales)])


def check_attention(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    kv_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    num_splits: int | None = None,
    block_size: int = 16,
    strided: bool = False,
    seed: int = 0,
    causal: bool = True,
    window: int = 0,
) -> TritonAttentionBackend:
    torch.manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    batch: PagedBatch = paged_batch(requests, block_size, device, seed=seed)
    md = batch.metadata
    num_tokens = sum(q for q, _ in requests)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if strided:  # q, k, v as the views a fused qkv projection gives
        qkv = torch.randn(num_tokens, width, device=device, dtype=dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    shape = TritonAttentionBackend.kv_cache_shape(batch.num_blocks, block_size, num_kv_heads, head_dim)
    cache = random_cache(shape, kv_dtype, dtype, scales, device)

    expected_cache = cache.clone()
    write_kv_cache_ref(k, v, expected_cache, md.slot_mapping, *scales)
    if kv_dtype == FP8:  # the reference attends to exactly what the cache holds
        k_ref, v_ref = (quantize_fp8_ref(t, s).float() * s for t, s in zip((k, v), scales))
    else:
        k_ref, v_ref = k.float(), v.float()
    ref_cache = dequantized(cache, scales)
    scale = head_dim**-0.5
    expected = TorchReferenceBackend().forward(q.float(), k_ref, v_ref, ref_cache, md, scale, causal=causal, window=window)

    backend = TritonAttentionBackend(num_splits=num_splits)
    out = backend.forward(q, k, v, cache, md, scale, *scales, causal=causal, window=window)

    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8)), "KV cache contents differ"
    err = (out.float() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err}"
    return backend


@pytest.mark.parametrize(
    "requests,heads,kv_heads,head_dim,dtype,device",
    [
        on_cpu(MIXED_TINY, 4, 2, 64, torch.float32, id="mixed-d64-f32"),
        on_cpu(MIXED_TINY, 8, 2, 128, torch.bfloat16, id="mixed-d128-bf16"),
        on_cpu(MIXED_TINY, 6, 2, 64, torch.float16, id="mixed-group3-f16"),
        on_cpu([(3, 20), (1, 50)], 2, 1, 256, torch.bfloat16, id="mixed-d256-bf16"),
        on_cpu([(9, 40), (1, 23)], 4, 4, 80, torch.float32, id="mha-d80-f32"),
        on_gpu(LLAMA_MIXED, 32, 8, 128, torch.bfloat16, id="llama-mixed-bf16"),
        on_gpu(LLAMA_MIXED, 32, 8, 128, torch.float16, id="llama-mixed-f16"),
        on_gpu(LLAMA_MIXED[:3], 16, 16, 64, torch.bfloat16, id="mha-d64-bf16"),
        on_gpu(LLAMA_MIXED[:3], 16, 8, 256, torch.bfloat16, id="d256-bf16"),
        on_gpu(LLAMA_MIXED[:3], 28, 4, 128, torch.bfloat16, id="group7-bf16"),
        on_gpu(LLAMA_MIXED[1:4], 32, 8, 128, torch.float32, id="llama-f32"),
    ],
)
def test_mixed_batch_matches_reference(requests, heads, kv_heads, head_dim, dtype, device) -> None:
    check_attention(requests, heads, kv_heads, head_dim, dtype, device)


@pytest.mark.parametrize(
    "requests,num_splits,kv_dtype,causal,window,device",
    [
        on_cpu([(4, 4), (5, 40), (16, 53), (3, 200)], None, None, False, 0, id="blocks-tiny"),
        on_cpu([(4, 37), (9, 90)], 3, None, False, 0, id="blocks-3-splits"),
        on_cpu([(4, 37), (9, 90)], None, FP8, False, 0, id="blocks-fp8"),
        on_cpu([(4, 37), (9, 90), (16, 200), (3, 5)], None, None, False, 20, id="blocks-window-20"),
        on_cpu([(4, 37), (9, 90), (16, 200)], 3, None, False, 33, id="blocks-window-33-splits"),
        on_cpu(MIXED_TINY, None, None, True, 17, id="causal-window-17"),
        on_cpu(DECODE_TINY, 4, None, True, 40, id="decode-window-40-splits"),
        on_gpu([(16, 16), (16, 4000), (16, 333), (16, 32768)], None, None, False, 0, id="blocks-16-llama"),
        on_gpu([(16, 16), (16, 4000), (16, 333)], None, FP8, False, 0, id="blocks-16-llama-fp8"),
        on_gpu([(16, 16), (16, 4000), (16, 333), (16, 32768)], None, None, False, 2048, id="blocks-16-window-2048"),
        on_gpu(LLAMA_MIXED, None, None, True, 1000, id="llama-mixed-causal-window-1000"),
        # Prompt chunks past DEEP_TILE_KEYS take the deep tiles; these grids are short of the machine, so split too.
        on_gpu([(770, 40000), (1, 30000), (37, 300)], None, FP8, True, 0, id="deep-chunk-fp8"),
        on_gpu([(770, 40000), (1, 20000), (64, 17000)], None, None, True, 0, id="deep-chunk-bf16"),
    ],
)
def test_non_causal_and_windowed_attention_match_reference(requests, num_splits, kv_dtype, causal, window, device) -> None:
    """causal=False (a block drafter's block): every row of a request sees all its keys, the
    block's own rows after it included; window > 0: none below its position - window + 1."""
    check_attention(requests, 8, 2, 64 if device == "cpu" else 128, torch.float32 if device == "cpu" else torch.bfloat16,
                    device, kv_dtype=kv_dtype, scales=(0.5, 2.0) if kv_dtype is not None else (1.0, 1.0),
                    num_splits=num_splits, causal=causal, window=window)


@pytest.mark.parametrize(
    "requests,num_splits,device",
    [
        on_cpu(DECODE_TINY, None, id="decode-auto-splits"),
        on_cpu(DECODE_TINY, 5, id="decode-5-splits"),
        on_cpu(MIXED_TINY, 3, id="mixed-3-splits"),
        on_cpu(DECODE_TINY, 16, id="decode-16-splits-mostly-empty"),
        on_gpu(LLAMA_DECODE, None, id="llama-decode-auto"),
        on_gpu(LLAMA_DECODE[:6], 64, id="llama-decode-64-splits"),
        on_gpu([(1, 32768)], None, id="llama-bs1-32k"),
        on_gpu(LLAMA_MIXED, 4, id="llama-mixed-4-splits"),
    ],
)
def test_split_kv_matches_reference(requests, num_splits, device) -> None:
    heads, kv_heads, head_dim = (8, 2, 64) if device == "cpu" else (32, 8, 128)
    backend = check_attention(requests, heads, kv_heads, head_dim, torch.bfloat16, device, num_splits=num_splits)
    md = paged_batch(requests, 16, device).metadata
    plan = backend.plan(md, sum(q for q, _ in requests), heads, kv_heads, head_dim, torch.device(device))
    assert plan.num_splits > 1
    assert (plan.block_q == 1) == all(q == 1 for q, _ in requests)


@pytest.mark.parametrize(
    "requests,max_len,device",
    [on_cpu(DECODE_TINY, 4096, id="tiny"), on_gpu(LLAMA_DECODE, 131072, id="llama")],
)
def test_plan_from_overstated_host_lengths(requests, max_len, device) -> None:
    """A captured decode graph plans from seq_lens_host = max_model_len; the kernels must use the
    true lengths on device, whatever split count that plan chose."""
    heads, kv_heads, head_dim = (4, 2, 64) if device == "cpu" else (32, 8, 128)
    torch.manual_seed(0)
    batch = paged_batch(requests, 16, device)
    md = batch.metadata
    q = torch.randn(len(requests), heads, head_dim, device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, batch.num_blocks, 16, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    backend = TritonAttentionBackend()
    overstated = dataclasses.replace(md, seq_lens_host=[max_len] * len(requests))
    plan = backend.plan(overstated, len(requests), heads, kv_heads, head_dim, torch.device(device))
    assert plan.num_splits > 1
    k_new = torch.stack([cache[0].view(-1, kv_heads, head_dim)[s] for s in md.slot_mapping.tolist()])
    v_new = torch.stack([cache[1].view(-1, kv_heads, head_dim)[s] for s in md.slot_mapping.tolist()])
    expected = TorchReferenceBackend().forward(q.float(), k_new.float(), v_new.float(), cache.float(), md, 0.1)
    for splits in (plan.num_splits, MAX_SPLITS):
        out = paged_attention(q, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.1,
                              dataclasses.replace(plan, num_splits=splits))
        assert (out.float() - expected).abs().max().item() < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "requests,heads,kv_heads,head_dim,dtype,scales,device",
    [
        on_cpu(MIXED_TINY, 8, 2, 64, torch.bfloat16, (0.125, 0.2), id="fp8-bf16"),
        on_cpu(DECODE_TINY, 4, 2, 128, torch.float32, (0.37, 1.3), id="fp8-decode-f32"),
        on_gpu(LLAMA_MIXED, 32, 8, 128, torch.bfloat16, (0.05, 0.03), id="llama-fp8-mixed"),
        on_gpu(LLAMA_DECODE, 32, 8, 128, torch.bfloat16, (1.0, 1.0), id="llama-fp8-decode"),
    ],
)
def test_fp8_kv_matches_dequantized_reference(requests, heads, kv_heads, head_dim, dtype, scales, device) -> None:
    check_attention(requests, heads, kv_heads, head_dim, dtype, device, kv_dtype=FP8, scales=scales)


@pytest.mark.parametrize(
    "requests,device",
    [on_cpu(MIXED_TINY, id="tiny"), on_gpu(LLAMA_MIXED, id="llama")],
)
def test_strided_qkv_views(requests, device) -> None:
    heads, kv_heads, head_dim = (4, 2, 64) if device == "cpu" else (32, 8, 128)
    check_attention(requests, heads, kv_heads, head_dim, torch.bfloat16, device, strided=True)


@pytest.mark.parametrize(
    "block_size,device",
    [on_cpu(8, id="page8-cpu"), on_cpu(64, id="page64-cpu"), on_gpu(32, id="page32-cuda"), on_gpu(128, id="page128-cuda")],
)
def test_other_block_sizes(block_size, device) -> None:
    """Pages smaller and larger than a KV tile (16 keys on CPU, 64 on CUDA)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    check_attention([(20, 70), (1, 130), (3, 3)], 4, 2, 64, dtype, device, block_size=block_size)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("device", [on_cpu(id="cpu")])
def test_rows_outside_every_request_are_untouched(device, num_splits) -> None:
    """Padded tokens of a CUDA-graph batch (beyond query_start_loc[-1]) are neither read nor written."""
    requests = [(1, 20), (1, 5)]
    md = paged_batch(requests, 16, device).metadata
    q = torch.randn(4, 4, 64)
    cache = torch.randn(2, 5, 16, 2, 64)
    plan = plan_attention(num_tokens=4, num_requests=2, max_query_len=1, max_seq_len=20, num_heads=4,
                          num_kv_heads=2, head_dim=64, device=q.device, num_splits=num_splits, min_split_tokens=1)
    out = torch.full_like(q, 7.0)
    paged_attention(q, cache[0], cache[1], md.query_start_loc, md.seq_lens, md.block_tables, 0.125, plan, out=out)
    assert torch.all(out[2:] == 7.0) and not torch.any(out[:2] == 7.0)


def test_h200_plans_split_batch_one_past_256_keys_into_single_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plans a captured 8B step gets on an H200 (132 multiprocessors): at batch 1 no split up
    to 256 keys (one program per KV head streams them in 128-key tiles), beyond that a split per
    64-key tile (decode and a verify step's rows alike); at batch 16 the grid is full first."""
    from tokenmill.kernels import attention

    monkeypatch.setattr(attention, "interpreting", lambda: False)
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)

    def plan(requests: int, rows: int, keys: int):
        return plan_attention(num_tokens=requests * rows, num_requests=requests, max_query_len=rows, max_seq_len=keys,
                              num_heads=32, num_kv_heads=8, head_dim=128, device=torch.device("cuda"))

    short = plan(1, 1, 256)
    assert (short.num_splits, short.block_n) == (1, 128)
    for keys, splits in ((512, 8), (1024, 16), (32768, MAX_SPLITS)):
        decode = plan(1, 1, keys)
        assert (decode.num_splits, decode.block_n, decode.min_split_tiles) == (splits, 64, 1)
    assert plan(1, 5, 256).num_splits == 1 and plan(1, 5, 512).num_splits == 8
    assert plan(16, 1, 2048).num_splits == 5  # 16 x 8 programs: four waves need five splits


@pytest.mark.skipif(not INTERPRETING, reason="interpreter off")
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_deep_prompt_chunk_split_by_the_rule_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    """The deep-chunk split chosen by the plan (keys per split and chunk rows lowered to reach it at a tiny depth;
    14 programs on the interpreter's 4 stand-in multiprocessors: 2 splits even out the last round)."""
    from tokenmill.kernels import attention

    monkeypatch.setattr(attention, "PREFILL_SPLIT_KEYS", 32)
    monkeypatch.setattr(attention, "DEEP_CHUNK_ROWS", 16)
    requests = [(48, 240)]
    kv = dtype if dtype == FP8 else None
    backend = check_attention(requests, 8, 2, 64, torch.bfloat16, "cpu", kv_dtype=kv, scales=(0.5, 0.25) if kv else (1.0, 1.0))
    md = paged_batch(requests, 16, "cpu").metadata
    plan = backend.plan(md, 48, 8, 2, 64, torch.device("cpu"), kv or torch.bfloat16)
    assert (plan.block_q, plan.num_tiles * 2, plan.num_splits) == (8, 14, 2)


def test_h200_plans_split_deep_prompt_chunks_to_even_out_their_last_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk at depth whose grid fills the machine: split along the keys where that evens
    out the last round of programs (each streams the same long key range), never at shallow depth."""
    from tokenmill.kernels import attention

    monkeypatch.setattr(attention, "interpreting", lambda: False)
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)

    def splits(chunk: int, depth: int, fp8: bool = True) -> tuple[int, int]:
        plan = plan_attention(num_tokens=chunk, num_requests=1, max_query_len=chunk, max_seq_len=depth + chunk,
                              num_heads=32, num_kv_heads=8, head_dim=128, device=torch.device("cuda"),
                              kv_dtype=FP8 if fp8 else torch.bfloat16)
        return plan.num_tiles * 8, plan.num_splits

    assert splits(770, 260_000) == (200, 7)  # 2 rounds unsplit, 11 / 7 = 1.57 split
    assert splits(1700, 100_000) == (432, 3)  # 4 rounds against 10 / 3
    assert splits(2048, 100_000) == (520, 1)  # 3.94 of 4 rounds busy: not worth a merge
    assert splits(8192, 0) == (2056, 1) and splits(8192, 8192) == (2056, 1)  # shallow: never
    # bf16 keys take 256-row tiles: half the programs, so a short grid is split to fill the machine
    assert splits(770, 260_000, fp8=False) == (104, 5)  # 1 round of 104 / 132 busy, against 4 / 5
    assert splits(2048, 100_000, fp8=False) == (264, 1)  # exactly 2 full rounds

    def tiles(keys: int, kv_dtype: torch.dtype, rows: int = 2048) -> tuple[int, int, int, int]:
        plan = plan_attention(num_tokens=rows, num_requests=1, max_query_len=rows, max_seq_len=keys, num_heads=32,
                              num_kv_heads=8, head_dim=128, device=torch.device("cuda"), kv_dtype=kv_dtype)
        return plan.block_m, plan.block_n, plan.num_warps, plan.num_stages

    bf16 = torch.bfloat16
    assert tiles(100_000, bf16) == (256, 64, 8, 4) and tiles(100_000, FP8) == (128, 64, 4, 4)  # the deep tiles
    # shallow chunks, float32 caches (four stages of 64 x 128 x 4 bytes overflow shared memory), verify rows
    assert tiles(8192, bf16) == tiles(100_000, torch.float32) == (128, 64, 8, 3) and tiles(100_000, bf16, rows=16)[2:] == (8, 3)
    assert attention.deep_prefill_splits(200, 132, 20_000, 1) == 1  # too few keys to split
    assert attention.deep_prefill_splits(200, 132, 260_000, 80 << 20) == 3  # 3 x 80 MiB of partials: the cap


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_does_not_synchronise() -> None:
    requests = LLAMA_MIXED
    md = paged_batch(requests, 16, "cuda").metadata
    num_tokens = sum(q for q, _ in requests)
    q = torch.randn(num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 4000, 16, 8, 128, device="cuda", dtype=FP8)
    backend = TritonAttentionBackend()
    backend.forward(q, k, k, cache, md, 0.1)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(q, k, k, cache, md, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

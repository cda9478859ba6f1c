"""The MLA layer on its Triton backend (the interpreter on CPU) against transformers: chunked
prefill, decode and verification steps in mixed batches, model-dtype and FP8 latent caches."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu
from mla_cases import PagedPool, hf_attention, hf_forward, mla_case, our_attention, run_schedule

from tokenmill.layers.attention.mla_backends import TritonMLABackend
from tokenmill.layers.attention.mla_ref import latent_cache_shape

# Request 0: a 5-token chunk (absorbed), a 19-token chunk (up-projected), a decode, a 1 + 4
# verification; request 1 beside it.
SCHEDULE = [[(0, 5), (1, 20)], [(0, 19), (1, 1)], [(0, 1), (1, 5)], [(0, 5), (1, 1)]]
LENGTHS = (30, 27)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    "name,cache_dtype,tolerance,device",
    [
        on_cpu("v3-q-lora-interleaved-yarn-bias", torch.float32, 1e-5, id="v3-f32"),
        on_cpu("kimi-nope", torch.float32, 1e-5, id="kimi-f32"),
        on_cpu("v2-no-q-lora-yarn", torch.float8_e4m3fn, 0.05, id="v2-fp8"),
        on_gpu("v2-no-q-lora-yarn", torch.float32, 1e-4, id="v2-f32-cuda"),
        on_gpu("v3-q-lora-interleaved-yarn-bias", torch.float8_e4m3fn, 0.05, id="v3-fp8-cuda"),
    ],
)
def test_triton_layer_matches_transformers(name, cache_dtype, tolerance, device) -> None:
    case = mla_case(name)
    hf = hf_attention(case)
    ours = our_attention(case, hf, TritonMLABackend(num_splits=2 if device == "cpu" else None), cache_dtype).to(device)
    ours.cache_scale = 0.02 if cache_dtype == torch.float8_e4m3fn else 1.0
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, case.config.hidden_size, generator=gen) for n in LENGTHS]
    pool = PagedPool(32, 4)
    for n in LENGTHS:
        pool.add(n)
    cache = torch.zeros(latent_cache_shape(32, 4, case.config.kv_lora_rank, case.config.qk_rope_head_dim),
                        device=device).to(cache_dtype)
    outs = run_schedule(ours, pool, cache, [x.to(device) for x in xs], SCHEDULE)
    for x, out in zip(xs, outs):
        assert relative_error(out.cpu(), hf_forward(case, hf, x)) < tolerance

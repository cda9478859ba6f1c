"""tokenmill's MLA layer (torch backend, float32, CPU) against transformers' DeepseekV2Attention,
DeepseekV3Attention and KimiLinearAttention: a whole sequence, then the same sequences as chunked
prefill into a paged latent cache, token-by-token decode and a verification step, in mixed
batches that take both the absorbed and the up-projected path."""

from __future__ import annotations

import pytest
import torch
from mla_cases import CASE_NAMES, PagedPool, hf_attention, hf_forward, mla_case, our_attention, run_schedule

from tokenmill.errors import ConfigError
from tokenmill.layers.attention import mla as mla_module
from tokenmill.layers.attention.mla import ABSORBED_MAX_QUERY_LEN, MLAAttention, takes_absorbed_path
from tokenmill.layers.attention.mla_backends import TorchMLABackend, mla_backend
from tokenmill.layers.attention.mla_ref import latent_cache_shape, quantize_latent_ref

BLOCK = 4
# Request A: prefill chunks of 5 (absorbed), 37 and 100 (up-projected), four decodes, then a
# verification step of 1 + 4 tokens. Request B runs beside it, so most steps mix both paths.
A_LEN, B_LEN = 5 + 37 + 100 + 4 + 5, 60
SCHEDULE = [
    [(0, 5), (1, 20)],
    [(0, 37), (1, 1)],
    [(0, 100), (1, 5)],
    [(0, 1), (1, 17)],
    [(0, 1), (1, 1)],
    [(0, 1)],
    [(1, 16), (0, 1)],
    [(0, 5)],
]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def sequences(hidden: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=gen) for n in (A_LEN, B_LEN)]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_whole_sequence_matches_transformers(name: str) -> None:
    case = mla_case(name)
    hf = hf_attention(case)
    ours = our_attention(case, hf)
    x = sequences(case.config.hidden_size)[0]
    pool = PagedPool(64, BLOCK)
    pool.add(len(x))
    cache = torch.zeros(latent_cache_shape(64, BLOCK, case.config.kv_lora_rank, case.config.qk_rope_head_dim))
    out = run_schedule(ours, pool, cache, [x], [[(0, len(x))]])[0]
    assert relative_error(out, hf_forward(case, hf, x)) < 1e-5


@pytest.mark.parametrize("name", CASE_NAMES)
def test_chunked_prefill_decode_and_verify_match_transformers(name: str) -> None:
    case = mla_case(name)
    hf = hf_attention(case)
    ours = our_attention(case, hf)
    xs = sequences(case.config.hidden_size)
    pool = PagedPool(64, BLOCK)
    for x in xs:
        pool.add(len(x))
    cache = torch.zeros(latent_cache_shape(64, BLOCK, case.config.kv_lora_rank, case.config.qk_rope_head_dim))
    outs = run_schedule(ours, pool, cache, xs, SCHEDULE)
    for x, out in zip(xs, outs):
        assert out.shape == x.shape
        assert relative_error(out, hf_forward(case, hf, x)) < 1e-5


def test_fp8_latent_cache_stays_close_to_transformers() -> None:
    """An FP8 cache with a per-layer scale: quantized on write, the scale folded back on read."""
    case = mla_case("v2-no-q-lora-yarn")
    hf = hf_attention(case)
    ours = our_attention(case, hf, cache_dtype=torch.float8_e4m3fn)
    xs = sequences(case.config.hidden_size)
    pool = PagedPool(64, BLOCK)
    for x in xs:
        pool.add(len(x))
    shape = latent_cache_shape(64, BLOCK, case.config.kv_lora_rank, case.config.qk_rope_head_dim)
    assert ours.cache_spec().shape(64) == shape and ours.cache_spec().dtype == torch.float8_e4m3fn
    cache = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    ours.cache_scale = 0.02  # latents reach ~ +-4 here: stored as up to ~200 of FP8's 448
    outs = run_schedule(ours, pool, cache, xs, SCHEDULE)
    for x, out in zip(xs, outs):
        assert relative_error(out, hf_forward(case, hf, x)) < 0.05
    # The cache holds x / scale in FP8 for every token of A: its fresh latent and rotated k_pe.
    _, _, latent, k_pe = ours.project(torch.arange(len(xs[0])), xs[0])
    slots = torch.tensor([pool.tables[0][p // BLOCK] * BLOCK + p % BLOCK for p in range(len(xs[0]))])
    stored = cache.view(-1, shape[-1]).view(torch.uint8)[slots].view(torch.float8_e4m3fn)
    expected = quantize_latent_ref(torch.cat((latent, k_pe), -1), 0.02)
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))


def test_the_path_rule_decides_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query runs up to 1 + 16 take the absorbed path, longer ones the up-projection; a mixed step splits."""
    assert takes_absorbed_path(1) and takes_absorbed_path(ABSORBED_MAX_QUERY_LEN)
    assert not takes_absorbed_path(ABSORBED_MAX_QUERY_LEN + 1)
    case = mla_case("v3-q-lora-neox")
    ours = our_attention(case, hf_attention(case))
    calls: list[tuple[str, list[int]]] = []
    for path in ("attend_absorbed", "attend_upprojected"):
        real = getattr(MLAAttention, path)

        def spy(self, q_nope, q_pe, cache, metadata, _real=real, _path=path):
            calls.append((_path, list(metadata.query_lens_host)))
            return _real(self, q_nope, q_pe, cache, metadata)

        monkeypatch.setattr(MLAAttention, path, spy)
    pool = PagedPool(64, BLOCK)
    for n in (40, 40, 40):
        pool.add(n)
    cache = torch.zeros(latent_cache_shape(64, BLOCK, 32, 8))
    xs = [torch.randn(40, 64) for _ in range(3)]
    run_schedule(ours, pool, cache, xs, [[(0, 17), (1, 18), (2, 1)], [(0, 1), (1, 1)], [(2, 20)]])
    assert calls == [("attend_absorbed", [17, 1]), ("attend_upprojected", [18]), ("attend_absorbed", [1, 1]),
                     ("attend_upprojected", [20])]


def test_configurations_that_cannot_run_fail_at_construction() -> None:
    case = mla_case("kimi-nope")
    config = type(case.config)(**{**case.config.to_dict(), "num_key_value_heads": 2})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        MLAAttention(config, None)
    with pytest.raises(ConfigError, match="rope style"):
        MLAAttention(mla_case("v3-q-lora-neox").config, "halves")
    with pytest.raises(ConfigError, match="latent cache dtype"):
        TorchMLABackend.check_supported(torch.bfloat16, torch.float16)
    with pytest.raises(ConfigError, match="latent cache dtype"):
        MLAAttention(mla_case("v3-q-lora-neox").config, "neox", cache_dtype=torch.float16)  # a float32 model
    with pytest.raises(ConfigError, match="no 'flash' attention backend"):
        mla_backend("flash")
    assert mla_module.mla_softmax_scale(mla_case("kimi-nope").config, 24, rotary=False) == 24**-0.5


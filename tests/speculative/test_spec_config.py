"""--speculative-config: vLLM's keys, and a clear error for each thing the engine cannot honour."""

from __future__ import annotations

import pytest

from tokenmill.config import BenchmarkOnlyConfig, SpeculativeConfig
from tokenmill.errors import ConfigError


def test_json_keys_become_fields() -> None:
    spec = SpeculativeConfig.from_json('{"method": "draft_model", "model": "d", "num_speculative_tokens": 3, '
                                       '"quantization": "fp8", "draft_kv_cache_dtype": "fp8"}')
    spec.check()
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.quantization) == ("draft_model", "d", 3, "fp8")
    assert SpeculativeConfig.from_json(None).method is None


@pytest.mark.parametrize(
    "text,message",
    [
        ("{not json", "not valid JSON"),
        ('{"method": "ngram", "gamma": 4}', r"unknown keys \['gamma'\]"),
        ('{"method": "eagle"}', "speculative method 'eagle' is unknown"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "mtp", "model": "d"}', 'target\'s own checkpoint: drop "model"'),
        ('{"method": "mtp", "quantization": "fp8"}', "the mtp method has none"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"in 1\.\.16"),
        ('{"method": "ngram", "verification": "tree"}', "must be token or block"),
        ('{"method": "ngram", "verification": "benchmark_accept_all"}', "benchmark-only mode"),
        ('{"method": "ngram", "benchmark_acceptance_length": 3.5}', "benchmark-only mode"),
        ('{"method": "ngram", "draft_sampling": "beam"}', "probabilistic or greedy"),
        ('{"method": "draft_model", "model": "d", "draft_kv_cache_dtype": "int8"}', "auto or fp8"),
        ('{"method": "draft_model", "model": "d", "quantization": "int4"}', "quantization must be fp8 or nvfp4"),
        ('{"method": "dflash"}', 'the dflash method needs "model"'),
        ('{"method": "dflash2", "model": "d", "head_quantization": "int8"}', "head_quantization must be fp8 or nvfp4"),
        ('{"method": "draft_model", "model": "d", "head_quantization": "fp8"}', "the draft_model method has none"),
        ('{"method": "ngram", "quantization": "fp8"}', "the ngram method has none"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ],
)
def test_what_cannot_be_honoured_is_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_json(text).check()


def test_a_benchmark_acceptance_length_is_within_what_gamma_allows() -> None:
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=3.5).check(spec)
    for length in (0.5, 4.5):
        with pytest.raises(ConfigError, match=r"must be in 1\.\.4"):
            BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=length).check(spec)
    with pytest.raises(ConfigError, match="needs benchmark_only.accept_all_drafts"):
        BenchmarkOnlyConfig(acceptance_length=3.5).check(spec)
    with pytest.raises(ConfigError, match="needs speculative decoding"):
        BenchmarkOnlyConfig(accept_all_drafts=True).check(SpeculativeConfig())

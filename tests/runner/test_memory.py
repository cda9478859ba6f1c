"""A model whose weights cannot fit is refused at start-up, before anything is allocated, with the
bytes it needs; a profile that leaves nothing for the KV cache names the weights' bytes too. The
device's memory is given on the CPU by replacing its query."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM
from tokenmill.errors import ConfigError
from tokenmill.models.llama import head_dim_of
from tokenmill.runner import memory

GIB = 2**30


def expected_weight_bytes(hf_model) -> int:
    """transformers' parameters in float32, plus the rotary cos / sin tables over max_model_len."""
    config = hf_model.config
    rotary = 2 * config.max_position_embeddings * head_dim_of(config) * 4
    return sum(p.numel() for p in hf_model.parameters()) * 4 + rotary


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return path, expected_weight_bytes(save_tiny_checkpoint("qwen3_moe", path))


def test_a_moe_model_that_does_not_fit_is_refused_with_its_bytes(moe: tuple[Path, int],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path, weight_bytes = moe
    total, in_use = 2 * GIB, GIB // 4
    monkeypatch.setattr(memory, "device_memory", lambda device: (total - in_use, total))
    usable = int(total * 0.9) - in_use - memory.GPU_HEADROOM_BYTES
    kv_fits = usable - weight_bytes
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=kv_fits)
    assert llm.engine.kv.num_blocks > 0
    with pytest.raises(ConfigError, match=rf"the model does not fit: its weights need 0.00 GiB \({weight_bytes:,} bytes\) "
                                          r"and 1.\d\d GiB of KV cache .*1.\d\d GiB of the device's 2.00 GiB are usable"):
        LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=kv_fits + 1)


def test_weights_alone_beyond_the_device_are_refused(moe: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    path, weight_bytes = moe
    monkeypatch.setattr(memory, "device_memory", lambda device: (GIB // 2, GIB // 2))
    with pytest.raises(ConfigError, match=rf"its weights need 0.00 GiB \({weight_bytes:,} bytes\), but 0.00 GiB"):
        LLM(str(path), device="cpu", dtype="float32")


def test_a_profile_without_room_for_the_kv_cache_names_the_weights() -> None:
    total, weights = 80 * GIB, 61 * GIB
    assert memory.budget_after_profile(total, weights + GIB, GIB, weights, 0.9) == int(0.9 * total) - 63 * GIB - (512 << 20)
    with pytest.raises(ConfigError, match=rf"the weights take 61.00 GiB \({weights:,} bytes\), the largest step peaks at "
                                          "71.00 GiB"):
        memory.budget_after_profile(total, 71 * GIB, GIB, weights, 0.9)

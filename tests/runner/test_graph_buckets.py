"""Which CUDA graphs a configuration captures: batch buckets up to max_num_seqs, context buckets up
to max_model_len, and two context buckets of a batch bucket share the larger one's graph when the
model's launch plans for them are equal. Checked on the CPU from the host-side plans alone (the
capture and replay themselves are GPU tests: tests/speculative/test_spec_cuda_graphs.py, the GPU
parity tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_checkpoint

import tokenmill.kernels.attention as kernels
from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.attention.triton_backend import TritonAttentionBackend
from tokenmill.runner.cuda_graphs import StepGraphs, batch_size_buckets, context_buckets

H200_SMS = 132


def llama_8b_plan(fp8: bool):
    """The Llama-3.1-8B attention layer's launch plan on an H200 (computed on the host, no GPU needed)."""
    def key(metadata: AttentionMetadata) -> kernels.AttentionPlan:
        return kernels.plan_attention(
            num_tokens=sum(metadata.query_lens_host), num_requests=metadata.num_requests,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len, num_heads=32, num_kv_heads=8,
            head_dim=128, device=torch.device("cuda"), kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return key


def graphs(max_batch: int, max_model_len: int, query_len: int = 1, plan_key=None) -> StepGraphs:
    return StepGraphs(None, max_batch, -(-max_model_len // 16), 0, 16, max_model_len,  # type: ignore[arg-type]
                      torch.device("cpu"), query_len, plan_key=plan_key)


def test_buckets_stop_at_the_configuration() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert context_buckets(300) == [256, 300]
    assert context_buckets(128) == [128]
    g = graphs(20, 300)
    assert sorted(g.shared) == [(b, c) for b in (1, 2, 4, 8, 16, 20) for c in (256, 300)]
    assert g.shared == {shape: shape for shape in g.shared}  # no plan key: every bucket its own graph


@pytest.mark.parametrize("fp8", [False, True])
def test_the_8b_shape_captures_49_decode_graphs_for_its_140_buckets(monkeypatch: pytest.MonkeyPatch, fp8: bool) -> None:
    monkeypatch.setattr(kernels, "sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)  # the GPU's plans, whatever TRITON_INTERPRET says
    plan = llama_8b_plan(fp8)
    g = graphs(256, 131072, plan_key=plan)
    assert len(g.shared) == 140 and len(g.distinct_shapes) == 49
    for (batch, context), (graph_batch, graph_context) in g.shared.items():
        assert graph_batch == batch and graph_context >= context  # a larger context's graph serves a smaller one
        small, large = g.static_context(batch, context).attention, g.static_context(batch, graph_context).attention
        assert plan(small) == plan(large)
    # Batch 1 keeps a graph for each split count its contexts need; from batch 72 one plan fits all.
    assert sorted({c for (b, c), (_, gc) in g.shared.items() if b == 1 and gc == c}) == [256, 1024, 131072]
    assert {g.shared[256, c] for c in g.contexts} == {(256, 131072)}
    verify = graphs(102, 131072, 5, plan_key=plan)  # 1 + 4 drafts: up to 512 tokens per step
    assert (len(verify.shared), len(verify.distinct_shapes)) == (64, 21)


def test_a_step_replays_its_buckets_shared_graph() -> None:
    g = graphs(8, 4096, plan_key=lambda metadata: min(metadata.max_seq_len, 1024))  # 1024 and up alike
    assert g.shared[4, 1024] == (4, 4096) and g.shared[4, 256] == (4, 256)
    metadata = g.static_context(3, 700).attention
    assert g.bucket(metadata) == (4, 1024)
    assert g.shared[g.bucket(metadata)] == (4, 4096)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", path)
    return path


def test_llama_keys_its_graphs_by_the_attention_plans(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, kv_cache_bytes=1 << 22)
    model = llm.engine.runner.model
    metadata = graphs(4, 64).static_context(2, 64).attention
    assert model.graph_plan_key(metadata) == 64  # the torch backend plans nothing: no sharing
    backend = TritonAttentionBackend()
    for layer in model.model.layers:
        layer.self_attn.backend = backend
    key = model.graph_plan_key(metadata)
    attn = model.model.layers[0].self_attn
    assert key == (backend.plan(metadata, 2, attn.num_heads, attn.num_kv_heads, attn.head_dim, torch.device("cpu")),)


def test_capture_mode_is_checked() -> None:
    assert EngineConfig(cuda_graph_capture="lazy").finalize(4096).cuda_graph_capture == "lazy"
    with pytest.raises(ConfigError, match="unknown --cuda-graph-capture 'later'; use eager or lazy"):
        EngineConfig(cuda_graph_capture="later").finalize(4096)

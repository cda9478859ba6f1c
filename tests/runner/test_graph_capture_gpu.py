"""CUDA graphs captured lazily (each the first time a step needs it, while other requests are
mid-generation) and eagerly with context buckets sharing graphs: greedy output equals eager-mode
decoding, with decode and verify graphs, and lazy mode captures only the graphs steps used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Answers of different lengths shrink the batch (new batch buckets mid-run); the long prompt
# crosses the 256-token context bucket while the others decode.
PROMPTS = [[5, 17, 99, 3, 250, 11], list(range(40, 72)) * 7 + [1, 2, 3], [7] * 20, [901, 2, 33]]
MAX_TOKENS = [48, 40, 24, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def generate(model_dir: Path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=2048, kv_cache_bytes=1 << 28,
              max_num_seqs=8, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return generate(model_dir, enforce_eager=True)[0]


def test_eager_capture_with_shared_contexts_is_exact(model_dir: Path, reference: list[list[int]]) -> None:
    tokens, llm = generate(model_dir)
    assert tokens == reference
    decode = llm.engine.runner.graphs[0]
    assert sorted(decode.capture_seconds) == sorted(decode.distinct_shapes)
    assert set(decode.graphs) == set(decode.shared)  # every bucket replays a captured graph


def test_lazy_capture_mid_generation_is_exact(model_dir: Path, reference: list[list[int]]) -> None:
    tokens, llm = generate(model_dir, cuda_graph_capture="lazy")
    assert tokens == reference
    decode = llm.engine.runner.graphs[0]
    used = set(decode.capture_seconds)
    assert used and used < set(decode.distinct_shapes)  # only what steps needed
    assert {context for _, context in used} >= {256, 1024}  # the long request crossed a context bucket
    llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    assert set(decode.capture_seconds) == used  # the same workload again captures nothing more


def test_lazy_verify_graphs_are_exact(model_dir: Path, reference: list[list[int]]) -> None:
    tokens, llm = generate(model_dir, cuda_graph_capture="lazy",
                           speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens == reference
    verify = next(g for g in llm.engine.runner.graphs if g.name == "verify")
    assert verify.capture_seconds

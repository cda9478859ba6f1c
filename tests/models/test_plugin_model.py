"""A model from outside the package plugs in with one registry call: a toy hybrid (attention over
paged KV beside recurrent layers with per-request state slots) runs through the unchanged
scheduler, runner and loader, and its greedy output equals a plain whole-sequence oracle under
chunked prefill, batching and preemption; its state slots come back when requests end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from toy_hybrid import ARCHITECTURE, ToyHybridForCausalLM
from transformers import LlamaConfig

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.kv.specs import FullAttentionSpec, RecurrentStateSpec
from tokenmill.layers.attention import TorchReferenceBackend
from tokenmill.layers.step_context import RequestInputSpec, StepContext
from tokenmill.models.interface import ModelBuild
from tokenmill.models.registry import register_model
from tokenmill.runner.batch import Chunk, pack
from tokenmill.runner.cuda_graphs import StepGraphs

VOCAB = 96
LAYERS = ["recurrent", "attention", "recurrent"]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    register_model(ARCHITECTURE, "toy_hybrid", "ToyHybridForCausalLM")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=len(LAYERS), max_position_embeddings=256, architectures=[ARCHITECTURE],
                         toy_layer_types=LAYERS)
    torch.manual_seed(0)
    model = ToyHybridForCausalLM(ModelBuild(config, TorchReferenceBackend(), 256))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("toy-hybrid")
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    assert json.loads((path / "config.json").read_text())["architectures"] == [ARCHITECTURE]
    return path


def reference_greedy(model: ToyHybridForCausalLM, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model.reference_logits(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40, 3, 29, 61)]


def test_the_toy_declares_its_cache_specs(toy_dir: Path) -> None:
    llm = LLM(str(toy_dir), device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    specs = llm.engine.runner.model.cache_specs()
    assert {type(s) for s in specs.values()} == {FullAttentionSpec, RecurrentStateSpec}
    assert list(specs) == ["blocks.0", "blocks.1", "blocks.2"]
    assert llm.engine.kv.state is not None and llm.engine.kv.state.num_slots == llm.engine.config.scheduler.max_num_seqs


@pytest.mark.parametrize("budget, kv_bytes, max_num_seqs", [(512, 1 << 20, 8), (7, 5 * 4096 + 1024, 3)],
                         ids=["one-shot", "chunked-preempted"])
def test_greedy_output_equals_the_whole_sequence_oracle(toy_dir: Path, budget: int, kv_bytes: int,
                                                        max_num_seqs: int) -> None:
    llm = LLM(str(toy_dir), device="cpu", dtype="float32", kv_cache_bytes=kv_bytes, max_num_batched_tokens=budget,
              max_num_seqs=max_num_seqs, max_model_len=80)
    oracle = llm.engine.runner.model
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # answers long enough to preempt
    outs = llm.generate(prompts(), params)
    for prompt, out in zip(prompts(), outs):
        assert out.outputs[0].token_ids == reference_greedy(oracle, prompt, 16)
    engine = llm.engine
    if max_num_seqs == 3:
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0 and engine.kv.state.num_free == engine.kv.state.num_slots
    # The same prompt again: the toy's recurrent layers write no state checkpoints, so no prefix
    # snapshot can resume their state: no hit, and the answer is the same.
    again = llm.generate([prompts()[2]], params)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_speculation_needs_state_checkpoints(toy_dir: Path) -> None:
    """Rolling the toy's state back to a draft position needs checkpoints it does not write: refused."""
    with pytest.raises(ConfigError, match="keep no checkpoints"):
        LLM(str(toy_dir), device="cpu", dtype="float32", kv_cache_bytes=1 << 20,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_graph_buffers_pad_state_slots_and_request_inputs(toy_dir: Path) -> None:
    """A decode step staged into the static buffers a CUDA graph replays (built on the CPU, never
    captured): padding requests take the scratch state slot and each request input's pad value,
    and the model run on the staged context gives the real rows' logits of the unstaged step."""
    llm = LLM(str(toy_dir), device="cpu", dtype="float32", kv_cache_bytes=1 << 20)
    runner = llm.engine.runner
    scratch_slot = runner.cache_plan.scratch_slot
    assert runner.step_graphs(runner.model, 8).scratch_state_slot == scratch_slot
    graphs = StepGraphs(runner.model, 8, runner.max_blocks_per_seq, runner.num_blocks, runner.block_size, 128,
                        runner.device, scratch_state_slot=scratch_slot,
                        request_inputs={"gain": RequestInputSpec((), torch.float32, pad=1.0)})
    with torch.inference_mode():
        tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        chunks = [Chunk(p, 0, t) for p, t in zip(prompts()[:3], tables)]
        ids, positions, metadata = pack(chunks, runner.block_size, runner.device)
        runner.model(ids, StepContext(positions, metadata, state_slots=torch.tensor([0, 1, 2])))
        saved = [block.state.clone() for block in runner.model.blocks if hasattr(block, "state")]
        step = [Chunk([7], len(p), t) for p, t in zip(prompts()[:3], tables)]
        ids, positions, metadata = pack(step, runner.block_size, runner.device)
        ctx = StepContext(positions, metadata, state_slots=torch.tensor([0, 1, 2]),
                          request_inputs={"gain": torch.tensor([0.5, 2.0, 3.0])})
        unstaged = runner.model.compute_logits(runner.model(ids, ctx))
        for block, state in zip([b for b in runner.model.blocks if hasattr(b, "state")], saved):
            block.state.copy_(state)
        bucket, context = graphs.stage(ids, ctx)
        assert bucket == 4
        static = graphs.static_context(bucket, context)
        assert static.state_slots.tolist() == [0, 1, 2, scratch_slot]
        assert static.request_inputs["gain"].tolist() == [0.5, 2.0, 3.0, 1.0]
        # The torch reference backend slices the cache by the host lengths, which a graph keeps at its
        # context bucket (its kernels read the device lengths): give it the true ones.
        true_lengths = [len(p) + 1 for p in prompts()[:3]] + [1]
        static.attention = dataclasses.replace(static.attention, seq_lens_host=true_lengths)
        staged = runner.model.compute_logits(runner.model(graphs.input_ids[:bucket], static))
    torch.testing.assert_close(staged[:3], unstaged, rtol=1e-5, atol=1e-5)

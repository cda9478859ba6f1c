"""Steering under CUDA graphs (GPU): decode steps replay the captured graphs for any mix of
strengths, and requests at strength 0 generate exactly what an engine without --steering does
(tokens and log-probabilities) in the same batches as requests at other strengths."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from steering_files import write_steering_dir
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu

STRENGTHS = [0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.25, 0.0, 2.0, 0.0]


def test_strength_zero_is_exact_under_cuda_graphs(tmp_path: Path) -> None:
    save_tiny_checkpoint("smollm2-shape", tmp_path)
    common = dict(device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_bytes=1 << 28, max_num_seqs=16)
    plain = LLM(str(tmp_path), **common)
    directory = write_steering_dir(plain.engine, tmp_path / "steer", layer=12)
    steered = LLM(str(tmp_path), **common, steering=str(directory), steering_max_strength=2.0)
    graphs = steered.engine.runner.graphs
    assert graphs and graphs[0].token_outputs  # captured, with the probe as a graph output
    replays = []
    run = graphs[0].run
    graphs[0].run = lambda ids, ctx: replays.append(ctx.attention.num_requests) or run(ids, ctx)  # type: ignore[method-assign]

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(5, 200))] for _ in STRENGTHS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    reference = plain.generate(prompts, params)
    outputs = steered.generate(prompts, params, steering=[{"refusal": s} for s in STRENGTHS])
    assert replays and max(replays) == len(prompts)  # every request decoded in replayed graphs, together
    changed = 0
    magnitude: dict[float, list[float]] = {0.0: [], 1.0: []}
    for strength, ref, out in zip(STRENGTHS, reference, outputs):
        if strength == 0:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
            assert out.outputs[0].logprobs == ref.outputs[0].logprobs
        else:
            changed += out.outputs[0].logprobs != ref.outputs[0].logprobs
        projections = out.direction_projections["refusal"]
        assert len(projections) == 4
        if strength in magnitude:
            magnitude[strength] += [abs(p) for p in projections]
    assert changed == sum(s != 0 for s in STRENGTHS)
    # Full ablation leaves only the bf16 rounding of the writes along the direction at its layer.
    assert sum(magnitude[1.0]) / len(magnitude[1.0]) < 0.3 * sum(magnitude[0.0]) / len(magnitude[0.0])
    torch.cuda.synchronize()

"""MTP speculation under CUDA graphs (the target's decode and verify graphs keeping the MTP tap,
the head's following and chained-draft graphs): greedy output equals plain eager decoding, the
head drafts exactly what it drafts eagerly (the same drafts accepted), and every graph family ran.
float32 on the GPU, the tests/mtp_models.py "copy" checkpoints (drafts accepted and rejected)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mtp_cases import make_checkpoint, vocab_of, workload

from tokenmill import LLM, SamplingParams
from tokenmill.runner.cuda_graphs import StepGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            make_checkpoint(name, made[name])
        return made[name]

    return get


def generate(path: Path, name: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, max_model_len=256, kv_cache_bytes=1 << 28,
              max_num_seqs=8, **kwargs)
    prompts = workload(vocab_of(name)) * 2  # ten requests: batch buckets of 8 and 2, padded rows
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)], llm


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek-v3", "qwen4exp"])
def test_mtp_under_graphs_equals_eager(name: str, checkpoints: Callable[[str], Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints(name)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    plain, _ = generate(path, name, enforce_eager=True)
    eager, eager_llm = generate(path, name, enforce_eager=True, speculative_config=spec)
    runs: Counter = Counter()
    original = StepGraphs.run_outputs

    def counting(self, *args):
        runs[self.name] += 1
        return original(self, *args)

    monkeypatch.setattr(StepGraphs, "run_outputs", counting)
    graphed, graphed_llm = generate(path, name, speculative_config=spec)
    eager_stats, graphed_stats = eager_llm.engine.stats(), graphed_llm.engine.stats()
    print(f"{name}: graph replays {dict(runs)}; accepted {graphed_stats.spec_num_accepted_tokens}/"
          f"{graphed_stats.spec_num_draft_tokens} (eager {eager_stats.spec_num_accepted_tokens}/"
          f"{eager_stats.spec_num_draft_tokens})")
    assert eager == plain and graphed == plain
    assert graphed_stats.spec_num_accepted_tokens == eager_stats.spec_num_accepted_tokens
    assert graphed_stats.spec_num_draft_tokens == eager_stats.spec_num_draft_tokens
    assert 0 < graphed_stats.spec_num_accepted_tokens < graphed_stats.spec_num_draft_tokens
    assert runs["verify"] > 0 and runs["MTP 4-row"] > 0 and runs["MTP 1-row"] > 0

"""Block drafters under CUDA graphs (the target's decode and verify graphs keeping the tapped layers,
the drafter's context graphs of both shapes and its block graph) on the Triton kernels (the
non-causal block attention among them): greedy output equals plain eager decoding and the
drafter drafts exactly what it drafts eagerly in float32; in bfloat16 (with a bf16 drafter
cache beside an FP8 target cache, and NVFP4 W4A16 drafter weights) sequences differ from plain
eager decoding only at near-ties (tests/parity.py). tests/dflash_models.py's repeat targets and
copy drafters: drafts accepted, rejected and accepted whole."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from dflash_models import TARGET_CONFIGS, drafter, save_drafter, save_target
from mtp_cases import workload
from parity import assert_same_or_near_ties

from tokenmill import LLM, SamplingParams
from tokenmill.runner.cuda_graphs import StepGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
GAMMA = 3


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    out = {}
    for name in ("llama", "qwen3_next"):
        target_dir = tmp_path_factory.mktemp(name)
        target = save_target(name, target_dir)
        config = TARGET_CONFIGS[name]
        drafts = {kind: save_drafter(drafter(config, kind, copy_from=target.get_input_embeddings().weight.detach(),
                                             target_layer_ids=(0, config.num_hidden_layers - 2)),
                                     tmp_path_factory.mktemp(f"{name}-{kind}")) for kind in ("dflash", "dflash2")}
        out[name] = (target_dir, drafts)
    return out


def generate(path: Path, name: str, dtype: str = "float32", **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16, max_model_len=256, kv_cache_bytes=1 << 28,
              max_num_seqs=8, **kwargs)
    prompts = workload(TARGET_CONFIGS[name].vocab_size - 1) * 2  # ten requests: batch buckets of 8 and 2, padded rows
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)], llm


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_block_drafters_under_graphs_equal_eager(name: str, kind: str, made, monkeypatch: pytest.MonkeyPatch) -> None:
    path, drafts = made[name]
    spec = {"method": kind, "model": str(drafts[kind]), "num_speculative_tokens": GAMMA}
    plain, _ = generate(path, name, enforce_eager=True)
    eager, eager_llm = generate(path, name, enforce_eager=True, speculative_config=spec)
    runs: Counter = Counter()
    original = StepGraphs.run_outputs

    def counting(self, *args):
        runs[self.name] += 1
        return original(self, *args)

    monkeypatch.setattr(StepGraphs, "run_outputs", counting)
    graphed, graphed_llm = generate(path, name, speculative_config=spec)
    a, b = eager_llm.engine.stats(), graphed_llm.engine.stats()
    print(f"{name} {kind}: graph replays {dict(runs)}; accepted {b.spec_num_accepted_tokens}/{b.spec_num_draft_tokens} "
          f"(eager {a.spec_num_accepted_tokens}/{a.spec_num_draft_tokens})")
    assert eager == plain and graphed == plain
    assert (b.spec_num_accepted_tokens, b.spec_num_draft_tokens) == (a.spec_num_accepted_tokens, a.spec_num_draft_tokens)
    assert 0 < b.spec_num_accepted_tokens < b.spec_num_draft_tokens
    assert runs["verify"] > 0 and runs["DFlash block"] > 0 and runs[f"DFlash context {GAMMA + 1}-row"] > 0


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("options", [{"draft_kv_cache_dtype": "auto"}, {"quantization": "nvfp4"}])
def test_bf16_graphs_beside_an_fp8_target_cache_differ_only_at_near_ties(kind: str, options: dict, made) -> None:
    path, drafts = made["llama"]
    spec = {"method": kind, "model": str(drafts[kind]), "num_speculative_tokens": GAMMA, **options}
    plain, reference = generate(path, "llama", "bfloat16", enforce_eager=True, kv_cache_dtype="fp8")
    graphed, llm = generate(path, "llama", "bfloat16", kv_cache_dtype="fp8", speculative_config=spec)
    model = llm.engine.proposer.model
    assert model.layers[0].self_attn.kv_cache.dtype == torch.bfloat16
    assert llm.engine.runner.model.model.layers[0].self_attn.kv_cache.dtype == torch.float8_e4m3fn
    ties = assert_same_or_near_ties(reference, workload(TARGET_CONFIGS["llama"].vocab_size - 1) * 2, plain, graphed)
    stats = llm.engine.stats()
    print(f"{kind} {options}: {ties} near-ties; accepted {stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens}")
    assert stats.spec_num_accepted_tokens > 0

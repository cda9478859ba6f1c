"""The sampling law with the block drafters (SPEC-DECODING.md's battery, end to end): a tiny random
Llama over a vocabulary of 8 with a random DFlash or DFlash2 drafter, requests sampled at
temperature 1 until 4 tokens exist (the first from the prompt's step, the others from verify
steps whose drafts were drawn, DFlash: from the drafter head's processed distribution at each
position; DFlash2: from the selector's row given the token drawn before, -inf outside its top-3
candidates, so q has zeros where p has mass). The law of the 4-token continuations must be the
target's product law exactly (Pearson chi-square as the MTP battery computes it, p > 1e-6), for
token-wise and block verification; drafts drawn from another distribution than the q declared
are rejected by the same harness at the same size."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from dflash_models import TARGET_CONFIGS, drafter, save_drafter, save_target
from test_mtp_sampling_law import ALPHA, chi2_pvalue

from tokenmill import LLM, SamplingParams
from tokenmill.speculative import draft_sampling

V, L, N = 8, 4, 24_000
PROMPT = [1, 5, 2, 7, 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], torch.Tensor]:
    """(the target, its drafters by kind, the exact law [V^L] of the target's continuations of PROMPT)."""
    path = tmp_path_factory.mktemp("llama-v8")
    target = save_target("llama-v8", path, repeat=False)
    config = TARGET_CONFIGS["llama-v8"]
    drafters = {kind: save_drafter(drafter(config, kind, target_layer_ids=(1, 0), top_k=3, group=8),
                                   tmp_path_factory.mktemp(kind)) for kind in ("dflash", "dflash2")}
    law = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for length in range(L):
            prefixes = list(itertools.product(range(V), repeat=length))
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])
            p = torch.softmax(target(ids).logits[:, -1].double(), dim=-1)
            law = (law[:, None] * p).reshape(-1)
    return path, drafters, law


def continuations(path: Path, draft: Path, kind: str, verification: str) -> tuple[torch.Tensor, float]:
    """(the cell of each of N sampled continuations, the mean accepted drafts per verify step)."""
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 26, max_model_len=64, max_num_seqs=512,
              max_num_batched_tokens=4096, enable_prefix_caching=False,
              speculative_config={"method": kind, "model": str(draft), "num_speculative_tokens": 2,
                                  "verification": verification})
    outputs = llm.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=L, ignore_eos=True))
    seqs = torch.tensor([o.outputs[0].token_ids for o in outputs])
    stats = llm.engine.spec_stats
    return (seqs * V ** torch.arange(L - 1, -1, -1)).sum(dim=1), stats.num_accepted_tokens / stats.num_drafts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("verification", ["token", "block"])
def test_block_drafts_keep_the_targets_law(checkpoints, kind: str, verification: str) -> None:
    path, drafters, law = checkpoints
    cells, accepted = continuations(path, drafters[kind], kind, verification)
    p = chi2_pvalue(cells, law)
    print(f"{kind} {verification}: p = {p:.3g}, {accepted:.2f} drafts accepted per verify step")
    assert 0.2 < accepted < 1.8  # both accepted and rejected drafts decide the law
    assert p > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_drafts_drawn_from_another_q_than_declared_are_caught(checkpoints, kind: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: draws from q^3 (renormalised) while q is declared."""
    path, drafters, law = checkpoints
    sample = draft_sampling._sample
    monkeypatch.setattr(draft_sampling, "_sample", lambda q: sample(q**3 / (q**3).sum(-1, keepdim=True)))
    cells, _ = continuations(path, drafters[kind], kind, "token")
    p = chi2_pvalue(cells, law)
    print(f"{kind} control p = {p:.3g}")
    assert p < ALPHA

"""The sampling law with the MTP proposer (SPEC-DECODING.md's battery, end to end): a tiny random
DeepSeek-V3 with an MTP head over a vocabulary of 8, requests sampled at temperature 1 until 3
tokens exist (the first from the prompt's step, the next two from verify steps whose drafts the
head drew from its own processed distribution, q as declared), many requests batched. The law of
the 3-token continuations must be the target's product law exactly (Pearson chi-square, sparse
cells merged, p > 1e-6; the law from transformers' forward of every prefix), for token-wise and
block verification; a head whose drafts are drawn from another distribution than the q it
declares must be rejected by the same harness at the same size."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from deepseek_models import deepseek_config
from mtp_models import deepseek_mtp_checkpoint
from scipy.stats import chi2

from tokenmill import LLM, SamplingParams
from tokenmill.speculative import draft_sampling

V, L, N = 8, 3, 12_000
PROMPT = [1, 5, 2, 7]
ALPHA = 1e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """(the checkpoint, the exact law [V^L] of its continuations of PROMPT at temperature 1)."""
    path = tmp_path_factory.mktemp("deepseek-v8-mtp")
    ck = deepseek_mtp_checkpoint(deepseek_config("v3-moe", vocab_size=V), path, mode="random")
    law = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for length in range(L):
            prefixes = list(itertools.product(range(V), repeat=length))
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])
            p = torch.softmax(ck.target(ids).logits[:, -1].double(), dim=-1)  # [V^length, V]
            law = (law[:, None] * p).reshape(-1)
    return path, law


def continuations(path: Path, verification: str) -> tuple[torch.Tensor, float]:
    """(the cell of each of N sampled continuations, the mean accepted drafts per verify step)."""
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 26, max_model_len=64, max_num_seqs=512,
              max_num_batched_tokens=4096, enable_prefix_caching=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "verification": verification})
    outputs = llm.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=L, ignore_eos=True))
    seqs = torch.tensor([o.outputs[0].token_ids for o in outputs])
    stats = llm.engine.spec_stats
    return (seqs * V ** torch.arange(L - 1, -1, -1)).sum(dim=1), stats.num_accepted_tokens / stats.num_drafts


def chi2_pvalue(cells: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson's test of the cells' counts against law; cells expecting fewer than 5 merged into one."""
    counts = torch.bincount(cells, minlength=law.numel()).double()
    expected = law * cells.numel()
    assert counts[law == 0].sum() == 0, "a continuation of probability 0 was sampled"
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


@pytest.mark.slow
@pytest.mark.parametrize("verification", ["token", "block"])
def test_mtp_drafts_keep_the_targets_law(checkpoint: tuple[Path, torch.Tensor], verification: str) -> None:
    path, law = checkpoint
    cells, accepted = continuations(path, verification)
    p = chi2_pvalue(cells, law)
    print(f"{verification}: p = {p:.3g}, {accepted:.2f} drafts accepted per verify step")
    assert 0.2 < accepted < 1.8  # both accepted and rejected drafts decide the law
    assert p > ALPHA


@pytest.mark.slow
def test_drafts_drawn_from_another_q_than_declared_are_caught(checkpoint: tuple[Path, torch.Tensor],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: draws from q^3 (renormalised) while q is declared."""
    path, law = checkpoint
    sample = draft_sampling._sample
    monkeypatch.setattr(draft_sampling, "_sample", lambda q: sample(q**3 / (q**3).sum(-1, keepdim=True)))
    cells, _ = continuations(path, "token")
    p = chi2_pvalue(cells, law)
    print(f"control p = {p:.3g}")
    assert p < ALPHA

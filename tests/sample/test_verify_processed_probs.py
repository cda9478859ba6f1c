"""processed_probs: the target distribution p that verification compares drafts against must be
exactly what the Sampler samples from (one code path), row by row, with every sampling option."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sample.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    exponential_argmax,
    processed_probs,
)
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
LOGITS_12 = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.0, -1.5, -2.0])


def row(params: SamplingParams, *, prompt=(), output=(), seed: int | None = None, banned=()) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), generator, banned)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution, computed independently in float64 (temperature, top-k, top-p
    over the top-k renormalised mass, then min-p)."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: p.top_k if p.top_k > 0 else len(probs)]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if p.top_p < 1.0:
        mass, kept = 0.0, torch.zeros_like(keep)
        for idx in torch.argsort(probs, descending=True).tolist():
            kept[idx] = True
            mass += probs[idx].item()
            if mass >= p.top_p:
                break
        probs = torch.where(kept, probs, 0.0) / probs[kept].sum()
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.1),
]


def test_rows_match_the_exact_filtered_distributions() -> None:
    logits = LOGITS_12.expand(len(CASES), -1).contiguous()
    before = logits.clone()
    got = processed_probs(logits, SamplingMetadata.build([row(c) for c in CASES], 12, CPU))
    assert got.dtype == torch.float32 and torch.equal(logits, before)
    for i, params in enumerate(CASES):
        torch.testing.assert_close(got[i].double(), reference(LOGITS_12, params), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("all_kind", ["greedy", "random"])
def test_uniform_batches_and_low_precision_logits(all_kind: str) -> None:
    params = SamplingParams(temperature=0.0 if all_kind == "greedy" else 1.3, top_k=5)
    gen = torch.Generator().manual_seed(1)
    # Distinct values even in bfloat16 (the sampler keeps ties at the k-th value; the reference does not).
    logits = torch.stack([torch.randperm(30, generator=gen) * 0.1 - 1.5 for _ in range(4)]).to(torch.bfloat16)
    got = processed_probs(logits, SamplingMetadata.build([row(params)] * 4, 30, CPU))
    for i in range(4):
        torch.testing.assert_close(got[i].double(), reference(logits[i].float(), params), rtol=1e-5, atol=1e-7)


def test_penalties_and_bans_are_applied() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5, -0.5, 0.0, 0.2]] * 2)
    penalised = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [row(penalised, prompt=[1, 2, 2], output=[2, 3, 3, 5], banned=[7]),
            row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[3])]
    got = processed_probs(logits, SamplingMetadata.build(rows, 8, CPU))
    # Hand-computed (see tests/layers/test_sampler.py), with token 7 banned.
    expected0 = torch.tensor([1.0, 1.0, -2.75, 0.5, 0.5, -1.75, 0.0, float("-inf")])
    torch.testing.assert_close(got[0], torch.softmax(expected0, dim=0))
    assert torch.equal(got[1], torch.nn.functional.one_hot(torch.tensor(1), 8).float())  # 3 - 2 < 2


def test_sampler_samples_exactly_from_processed_probs() -> None:
    """Same RNG state: Sampler.forward's tokens equal exponential-argmax draws from processed_probs
    (greedy rows: its one-hot argmax), seeded and unseeded rows alike."""
    torch.manual_seed(0)
    logits = torch.randn(7, 40)
    specs = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(top_k=5, top_p=0.9), 3),
        (SamplingParams(temperature=1.4, min_p=0.05), None),
        (SamplingParams(temperature=0.0, repetition_penalty=1.5), None),
        (SamplingParams(temperature=0.8, presence_penalty=1.0), 9),
        (SamplingParams(top_p=0.5), None),
        (SamplingParams(), None),
    ]

    def metadata() -> SamplingMetadata:
        return SamplingMetadata.build([row(p, prompt=[1, 2], output=[2, 5], seed=s) for p, s in specs], 40, CPU)

    for step in range(20):
        torch.manual_seed(100 + step)
        sampled = Sampler()(logits, metadata()).sampled_token_ids
        md = metadata()
        probs = processed_probs(logits, md)
        torch.manual_seed(100 + step)
        drawn = exponential_argmax(probs.clone(), md.generators)
        assert md.greedy_mask is not None
        expected = torch.where(md.greedy_mask, probs.argmax(dim=-1), drawn)
        assert torch.equal(sampled, expected)
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(7))


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="do not match"):
        processed_probs(torch.zeros(3, 10), SamplingMetadata.build([row(SamplingParams())] * 2, 10, CPU))

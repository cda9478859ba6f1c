"""Sampler: greedy, seeded reproducibility, exact filtered distributions, penalties, bans,
logprobs, mixed batches, and no host synchronisation inside forward."""

from __future__ import annotations

import math

import pytest
import torch
from no_host_sync import forbid_host_reads

from tokenmill.sample.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    apply_penalties,
)
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Distinct logits whose top-p / min-p cut points are far from any boundary.
LOGITS_12 = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.0, -1.5, -2.0])
NUM_DRAWS = 100_000


def row(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    banned: list[int] | tuple[int, ...] = (),
) -> SamplingRow:
    params = params or SamplingParams()
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
    return SamplingRow(params, prompt or [], output or [], generator, banned)


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    metadata = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return Sampler()(logits, metadata)


# ---------------------------------------------------------------- reference distributions


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact distribution the brief specifies, computed independently in float64."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else len(probs)
    keep[order[:k]] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if p.top_p < 1.0:
        mass, kept = 0.0, torch.zeros_like(keep)
        for idx in torch.argsort(probs, descending=True).tolist():
            kept[idx] = True
            mass += probs[idx].item()
            if mass >= p.top_p:
                break
        probs = torch.where(kept, probs, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; a count where probs is 0 rejects outright."""
    counts, probs = counts.double(), probs.double()
    if (counts[probs == 0] > 0).any():
        return 0.0
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0).item()


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int = NUM_DRAWS) -> torch.Tensor:
    batch = logits.expand(n, -1).contiguous()
    out = sample(batch, [row(params)] * n).sampled_token_ids
    return torch.bincount(out, minlength=logits.shape[-1])


# ------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_and_leaves_logits_untouched(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 300).to(dtype)
    before = logits.clone()
    metadata = SamplingMetadata.build([row(SamplingParams(temperature=0.0))] * 7, 300, CPU)
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.temperature is None and metadata.top_k is None and metadata.penalties is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None
    assert torch.equal(logits, before)


def test_shape_mismatch_is_refused() -> None:
    metadata = SamplingMetadata.build([row()] * 2, 10, CPU)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(3, 10), metadata)


# --------------------------------------------------------------------------- randomness


def run_steps(rows: list[SamplingRow], logits: torch.Tensor, steps: int) -> torch.Tensor:
    return torch.stack([sample(logits, rows).sampled_token_ids for _ in range(steps)], dim=1)


def test_seeded_rows_reproduce_across_batch_composition_and_position() -> None:
    torch.manual_seed(1)
    v = 1000
    target_logits = torch.randn(v) * 0.5
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    # Alone.
    alone = run_steps([row(params, seed=1234)], target_logits[None], steps=8)[0]
    # First of three, with other seeded and unseeded neighbours.
    batch_a = torch.stack([target_logits, torch.randn(v), torch.randn(v)])
    rows_a = [row(params, seed=1234), row(SamplingParams(seed=5), seed=5), row()]
    in_a = run_steps(rows_a, batch_a, steps=8)[0]
    # Fourth of five, with greedy, top-k, min-p and penalised neighbours.
    batch_b = torch.cat([torch.randn(3, v), target_logits[None], torch.randn(1, v)])
    rows_b = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(top_k=3)),
        row(SamplingParams(min_p=0.3, presence_penalty=1.0), output=[1, 2]),
        row(params, seed=1234),
        row(SamplingParams(temperature=1.5), seed=77),
    ]
    in_b = run_steps(rows_b, batch_b, steps=8)[3]

    assert torch.equal(alone, in_a) and torch.equal(alone, in_b)
    # A different seed gives a different sequence (8 draws over ~1000 tokens).
    other = run_steps([row(params, seed=4321)], target_logits[None], steps=8)[0]
    assert not torch.equal(alone, other)


def test_unseeded_rows_differ() -> None:
    torch.manual_seed(2)
    logits = torch.zeros(2, 1000)  # uniform: identical draws would be a 1e-3 coincidence per step
    draws = run_steps([row(), row()], logits, steps=10)
    assert not torch.equal(draws[0], draws[1])
    again = run_steps([row(), row()], logits, steps=10)
    assert not torch.equal(draws, again)


# ---------------------------------------------------------------------- distributions


DISTRIBUTION_CASES = {
    "temperature_1": SamplingParams(),
    "temperature_0.5": SamplingParams(temperature=0.5),
    "temperature_2": SamplingParams(temperature=2.0),
    "top_k_3": SamplingParams(top_k=3),
    "top_p_0.7": SamplingParams(top_p=0.7),
    "min_p_0.2": SamplingParams(min_p=0.2),
    "all_filters": SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.1),
    "top_k_top_p_hot": SamplingParams(temperature=1.6, top_k=8, top_p=0.6),
}


@pytest.mark.parametrize("name", list(DISTRIBUTION_CASES))
def test_empirical_distribution_matches_exact(name: str) -> None:
    params = DISTRIBUTION_CASES[name]
    torch.manual_seed(3)
    counts = draw_counts(LOGITS_12, params)
    expected = reference_probs(LOGITS_12, params)
    assert chi_square_pvalue(counts, expected) > 1e-4
    # Negative control: the unfiltered temperature-1 softmax (or, for that case, T=1.3) is rejected.
    wrong = SamplingParams(temperature=1.3) if name == "temperature_1" else SamplingParams()
    assert chi_square_pvalue(counts, reference_probs(LOGITS_12, wrong)) < 1e-4


def test_negative_control_detects_small_temperature_error() -> None:
    torch.manual_seed(4)
    counts = draw_counts(LOGITS_12, SamplingParams(temperature=1.0))
    assert chi_square_pvalue(counts, reference_probs(LOGITS_12, SamplingParams())) > 1e-4
    assert chi_square_pvalue(counts, reference_probs(LOGITS_12, SamplingParams(temperature=1.1))) < 1e-4


def test_per_row_parameters_in_one_batch() -> None:
    torch.manual_seed(5)
    cases = [SamplingParams(top_k=2), SamplingParams(top_p=0.5, temperature=0.8), SamplingParams(min_p=0.4)]
    n = 40_000
    rows = [row(cases[i % 3]) for i in range(3 * n)]
    out = sample(LOGITS_12.expand(3 * n, -1).contiguous(), rows).sampled_token_ids.view(n, 3)
    for j, params in enumerate(cases):
        counts = torch.bincount(out[:, j], minlength=12)
        assert chi_square_pvalue(counts, reference_probs(LOGITS_12, params)) > 1e-4


# ------------------------------------------------------------------- penalties and bans


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor(
        [
            [1.0, 2.0, -1.0, 3.0, 0.5, -0.5, 0.0, 0.2],
            [1.0, 2.0, -1.0, 3.0, 0.5, -0.5, 0.0, 0.2],
        ]
    )
    penalised = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [
        row(penalised, prompt=[1, 2, 2], output=[2, 3, 3, 5]),
        row(SamplingParams(), prompt=[1, 2], output=[3, 3]),  # no penalties: untouched
    ]
    metadata = SamplingMetadata.build(rows, 8, CPU)
    assert metadata.penalties is not None
    got = apply_penalties(logits.clone(), metadata.penalties)
    # token: 0 unseen; 1 prompt, +2.0/2; 2 prompt+output(1), -1*2 -0.25 -0.5; 3 output(2), 3/2 -0.5 -0.5;
    # 4 unseen; 5 output(1), -0.5*2 -0.25 -0.5; 6, 7 unseen.
    expected0 = torch.tensor([1.0, 1.0, -2.75, 0.5, 0.5, -1.75, 0.0, 0.2])
    torch.testing.assert_close(got[0], expected0)
    torch.testing.assert_close(got[1], logits[1])
    # End to end: greedy picks token 3 without penalties and token 0 with them (tie 0/1 -> 0).
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = sample(logits, [row(greedy, prompt=[1, 2, 2], output=[2, 3, 3, 5]), row(SamplingParams(temperature=0))])
    assert out.sampled_token_ids.tolist() == [0, 3]


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    metadata = SamplingMetadata.build([row(params, prompt=[0, 1], output=[1, 1])], 4, CPU)
    got = apply_penalties(logits, metadata.penalties)
    torch.testing.assert_close(got[0], torch.tensor([0.0, -3.0, 0.0, 0.0]))


def test_banned_ids_are_never_sampled() -> None:
    torch.manual_seed(6)
    logits = torch.tensor([5.0, 4.5, 0.0, 0.0, -1.0, 4.9]).expand(20_000, -1).contiguous()
    rows = [row(SamplingParams(temperature=1.5), banned=[0, 5]) for _ in range(20_000)]
    out = sample(logits, rows).sampled_token_ids
    assert not torch.isin(out, torch.tensor([0, 5])).any()
    assert (out == 1).float().mean() > 0.5  # the best remaining token dominates
    greedy = sample(logits[:2], [row(SamplingParams(temperature=0), banned=[0, 5]), row(SamplingParams(temperature=0))])
    assert greedy.sampled_token_ids.tolist() == [1, 0]
    # Out-of-range ids are ignored rather than spilling into a neighbouring row.
    metadata = SamplingMetadata.build([row(banned=[6, 99, -1]), row()], 6, CPU)
    assert metadata.banned_flat_ids is None


# ---------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_top_k_ids() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, 50, dtype=torch.bfloat16)
    rows = [
        row(SamplingParams(temperature=0.5, top_k=3, logprobs=5), banned=[int(logits[0].float().argmax())]),
        row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), prompt=[1, 2, 3]),
        row(SamplingParams(logprobs=0), seed=3),
        row(SamplingParams(presence_penalty=2.0), output=[4]),  # no logprobs requested
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.logprob_token_ids))
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    # Raw means raw: the banned argmax of row 0 still carries its (highest) logprob.
    assert out.logprob_token_ids[0, 1] == logits[0].float().argmax()


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    logits = torch.randn(2, 10)
    out = sample(logits, [row(SamplingParams(logprobs=0)), row(SamplingParams(temperature=0))])
    assert out.logprob_token_ids.shape == (2, 1)
    torch.testing.assert_close(
        out.logprobs[:, 0], torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])[:, 0]
    )


# ------------------------------------------------------------------------- mixed batch


def test_mixed_greedy_and_random_batch() -> None:
    torch.manual_seed(8)
    v = 64
    logits = torch.randn(6, v)
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, top_k=20)),
        row(SamplingParams(temperature=0.0, top_p=0.1)),  # filters are ignored for greedy rows
        row(SamplingParams(temperature=2.0, min_p=0.01), seed=9),
        row(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[int(logits[4].argmax())]),
        row(SamplingParams(temperature=1.0)),
    ]
    metadata = SamplingMetadata.build(rows, v, CPU)
    assert not metadata.all_greedy and not metadata.all_random
    assert list(metadata.generators) == [3]
    draws = torch.stack([Sampler()(logits, metadata).sampled_token_ids for _ in range(30)], dim=1)
    penalised = logits[4].clone()
    penalised[logits[4].argmax()] -= 1.0
    assert (draws[0] == logits[0].argmax()).all()
    assert (draws[2] == logits[2].argmax()).all()
    assert (draws[4] == penalised.argmax()).all()
    for i in (1, 3, 5):  # random rows vary over 30 steps
        assert draws[i].unique().numel() > 1
    top20 = logits[1].topk(20).indices
    assert torch.isin(draws[1], top20).all()


# ---------------------------------------------------------------------------- no sync


def _forbid(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_host_reads(monkeypatch, "Sampler.forward")


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # covers the top-k-only path and the sort path
def test_forward_never_reads_tensor_values_on_host(monkeypatch: pytest.MonkeyPatch, top_p: float) -> None:
    torch.manual_seed(9)
    v = 40
    logits = torch.randn(6, v, dtype=torch.bfloat16)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=3)),
        row(SamplingParams(top_k=5, top_p=top_p, min_p=0.05), seed=1, banned=[0, 1]),
        row(SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2), prompt=[2, 3], output=[3, 4, 4]),
        row(SamplingParams(temperature=0.7, top_k=9), seed=2),
        row(SamplingParams(logprobs=1)),
        row(SamplingParams(temperature=0.0, repetition_penalty=0.8), prompt=[5]),
    ]
    metadata = SamplingMetadata.build(rows, v, CPU)
    all_greedy = SamplingMetadata.build([row(SamplingParams(temperature=0.0), banned=[2])] * 6, v, CPU)
    expected_greedy = logits[0].float().argmax()
    _forbid(monkeypatch)
    with pytest.raises(AssertionError, match="host synchronisation"):
        torch.zeros(1).item()  # the patch is live
    out = Sampler()(logits, metadata)
    greedy_out = Sampler()(logits, all_greedy)
    monkeypatch.undo()
    assert out.sampled_token_ids[0] == expected_greedy
    assert out.sampled_token_ids.shape == (6,) and greedy_out.sampled_token_ids.shape == (6,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_does_not_synchronise_on_cuda() -> None:
    device = torch.device("cuda")
    v = 32_000
    logits = torch.randn(8, v, device=device, dtype=torch.bfloat16)
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5), [1, 2], [3], None),
        SamplingRow(SamplingParams(top_k=50, top_p=0.9, min_p=0.05, seed=0), [1], [2], generator, (0, 1)),
        SamplingRow(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5), [1, 2], [3, 3], None),
        SamplingRow(SamplingParams(top_k=20), [], [], None),
    ] * 2
    metadata = SamplingMetadata.build(rows, v, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert not math.isnan(out.logprobs.float().sum().item())


def test_row_argmax_two_pass_equals_argmax_and_keeps_the_first_maximum() -> None:
    from tokenmill.sample.sampler import row_argmax

    torch.manual_seed(0)
    logits = torch.randn(3, 128256)
    logits[1, 70000] = logits[1, 90000] = 50.0  # a tie across chunks: the first one wins
    logits[2, 300] = logits[2, 301] = 50.0  # a tie inside a chunk
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    assert row_argmax(logits).tolist()[1:] == [70000, 300]
    odd = torch.randn(2, 1001)  # not a multiple of the chunk: one pass
    assert torch.equal(row_argmax(odd), odd.argmax(dim=-1))

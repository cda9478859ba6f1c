"""Speculative verification: the statistical battery of SPEC-DECODING.md, on CPU.

A synthetic order-1 "language": the target distribution at every position is p(. | previous
token) and the draft's is q(. | previous token), both processed by the real sampler code
(temperature, top-k, top-p) from context-dependent random logits over V = 8 tokens. Many chains
run in one batch: each step drafts gamma tokens from q conditioned on what the chain has emitted,
verifies them, and appends the tau + 1 emitted tokens, until L = 4 tokens exist (so the first L
tokens span several verify steps). Their law must equal the target's product distribution over
all 8^4 sequences exactly (Pearson chi-square, sparse cells merged, p > 1e-6); deliberately wrong
variants of the algorithm (defined at the bottom of this module, never in the product) must be
rejected by the same harness with p < 1e-6, at a sample size whose power is shown to be >= 0.999.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from no_host_sync import forbid_host_reads

from tokenmill.sample import rejection as verify_module
from tokenmill.sample.rejection import (
    VerifyInput,
    VerifyOutput,
    accept_all,
    benchmark_accepted,
    verify_block,
    verify_greedy,
    verify_tokenwise,
)
from tokenmill.sample.sampler import SamplingMetadata, SamplingRow, exponential_argmax, processed_probs
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 8  # vocabulary
L = 4  # tokens per chain compared against the exact law
START = 0  # the context every chain starts from
ALPHA = 1e-6  # every test's significance level
N_CHAINS = 200_000
RULES: dict[str, Callable[[VerifyInput], VerifyOutput]] = {"token": verify_tokenwise, "block": verify_block}
Verifier = Callable[[VerifyInput], VerifyOutput]


# ------------------------------------------------------------------------------ tables


@dataclass(frozen=True)
class Tables:
    p: torch.Tensor  # [V, V] float32: target p(. | previous token), as the sampler processes it
    q: torch.Tensor  # [V, V] float32: q(. | previous token) as declared to the verifier
    q_draw: torch.Tensor  # [V, V]: what drafts are really drawn from (q, except in a negative control)
    one_hot: bool  # greedy drafting: declare q as one-hot (draft_probs=None)


def _process(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    rows = [SamplingRow(params, [], [], None)] * logits.shape[0]
    return processed_probs(logits, SamplingMetadata.build(rows, logits.shape[1], CPU))


def make_tables(
    draft: str = "near",
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    draft_temperature: float | None = None,
) -> Tables:
    """draft: "near" (a perturbed copy of the target), "same" (p = q), "disjoint" (supports never
    overlap), "zeros" (q is 0 on tokens where p > 0), "greedy" (one-hot q: drafting at T = 0).
    Temperature and truncation apply to both tables' logits, as a real deployment does."""
    g = torch.Generator().manual_seed(seed)
    target = 1.6 * torch.randn(V, V, generator=g)
    noise = 0.9 * torch.randn(V, V, generator=g)
    drafter = target if draft == "same" else target + noise
    if draft == "disjoint":
        mask = torch.rand(V, V, generator=g) < 0.5
        mask[:, 0], mask[:, 1] = True, False
        target = target.masked_fill(~mask, float("-inf"))
        drafter = drafter.masked_fill(mask, float("-inf"))
    if draft == "zeros":
        banned = torch.rand(V, V, generator=g).argsort(dim=1)[:, :3]
        drafter = drafter.scatter(1, banned, float("-inf"))
    p = _process(target, temperature, top_k, top_p)
    q_temperature = 0.0 if draft == "greedy" else temperature
    q = _process(drafter, q_temperature, top_k, top_p)
    q_draw = q if draft_temperature is None else _process(drafter, draft_temperature, top_k, top_p)
    return Tables(p=p, q=q, q_draw=q_draw, one_hot=draft == "greedy")


def exact_law(p: torch.Tensor, length: int = L) -> torch.Tensor:
    """[V^length] float64: P(s_1..s_length) = prod_j p(s_j | s_{j-1}), s_0 = START, row-major."""
    p = p.double()
    law = p[START]
    for _ in range(length - 1):
        law = (law.view(-1, V, 1) * p.view(1, V, V)).reshape(-1)
    return law


def sequence_index(seqs: torch.Tensor) -> torch.Tensor:
    weights = V ** torch.arange(seqs.shape[1] - 1, -1, -1)
    return (seqs * weights).sum(dim=1)


# ------------------------------------------------------------------------------ harness


@dataclass
class Run:
    seqs: torch.Tensor  # [N, L] the first L emitted tokens of every chain
    taus: list[torch.Tensor]  # per step: tau of every active chain (when recording)
    expected: list[torch.Tensor]  # per step: E[tau | drafts] from the tables (when recording)
    drafts: list[tuple[torch.Tensor, torch.Tensor]]  # per step: (contexts, num_drafts) (when recording)


def run_chains(
    tables: Tables,
    gamma: int,
    n: int,
    verify: Verifier,
    *,
    vary: bool = False,
    seeded: int = 0,
    greedy: int = 0,
    law: str | None = None,
    seed: int = 0,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> Run:
    """Runs n chains until each has L tokens. The first `seeded` chains carry their own generator,
    the last `greedy` chains are temperature-0 rows, `vary` draws num_drafts in 0..gamma per row and
    step (padding: draft id -1, NaN probabilities), `law` records tau and E[tau | drafts], and
    `on_step` sees the indices of the chains in each step's batch."""
    torch.manual_seed(seed)
    generators = {i: torch.Generator().manual_seed(10_000 + seed * n + i) for i in range(seeded)}
    greedy_rows = torch.arange(n) >= n - greedy
    last = torch.full((n,), START, dtype=torch.int64)
    seqs = torch.full((n, L), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    run = Run(seqs, [], [], [])
    while True:
        active = (count < L).nonzero().squeeze(1)  # the harness may sync; the verifier may not
        m = active.numel()
        if m == 0:
            return run
        context = last[active]
        drafts = []
        for _ in range(gamma):
            context = exponential_argmax(tables.q_draw[context], {})
            drafts.append(context)
        x = torch.stack(drafts, dim=1) if gamma else torch.zeros(m, 0, dtype=torch.int64)
        contexts = torch.cat([last[active].unsqueeze(1), x], dim=1)  # [m, gamma + 1]
        target = tables.p[contexts]
        draft_probs = None if tables.one_hot else tables.q[contexts[:, :gamma]]
        num = torch.randint(0, gamma + 1, (m,)) if vary else torch.full((m,), gamma)
        if vary:
            pad = torch.arange(gamma) >= num.unsqueeze(1)
            x = x.masked_fill(pad, -1)
            target = target.masked_fill(torch.cat([pad.new_zeros(m, 1), pad], 1).unsqueeze(-1), float("nan"))
            if draft_probs is not None:
                draft_probs = draft_probs.masked_fill(pad.unsqueeze(-1), float("nan"))
        if on_step is not None:
            on_step(active)
        row_of = {int(c): j for j, c in enumerate(active[active < seeded])}
        out = verify(
            VerifyInput(
                target_probs=target,
                draft_token_ids=x,
                draft_probs=draft_probs,
                num_drafts=num,
                greedy=greedy_rows[active] if greedy else None,
                generators={j: generators[c] for c, j in row_of.items()},
            )
        )
        tau = out.num_accepted
        assert ((tau >= 0) & (tau <= num)).all()
        tokens = out.output_token_ids
        column = torch.arange(gamma + 1)
        assert (tokens.gather(1, tau.unsqueeze(1)) >= 0).all() and (tokens[column > tau.unsqueeze(1)] == -1).all()
        accepted = column[:gamma] < tau.unsqueeze(1)
        assert torch.equal(tokens[:, :gamma][accepted], x[accepted])
        if law is not None:
            run.taus.append(tau)
            run.expected.append(expected_tau(law, tables, contexts, num))
            run.drafts.append((contexts, num))
        for j in range(gamma + 1):
            position = count[active] + j
            ok = (j <= tau) & (position < L)
            seqs[active[ok], position[ok]] = tokens[ok, j]
        last[active] = tokens.gather(1, tau.unsqueeze(1)).squeeze(1)
        count[active] += tau + 1


# ---------------------------------------------------------------------- statistics


def merged_cells(law: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell of every sequence or -1 for impossible ones, expected fraction per cell): sequences
    with expected count < 5 share one pooled cell (added to the smallest cell if still < 5)."""
    law = law.double()
    possible = law > 0
    big = possible & (law * n >= 5)
    cell = torch.full(law.shape, -1, dtype=torch.int64)
    cell[big] = torch.arange(int(big.sum()))
    pooled = possible & ~big
    if pooled.any():
        pool_cell = int(big.sum())
        if law[pooled].sum() * n < 5 and big.any():
            pool_cell = int(law.masked_fill(~big, math.inf).argmin().item())
            pool_cell = int(cell[pool_cell])
        cell[pooled] = pool_cell
    cells = int(cell.max()) + 1
    expected = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell[possible], law[possible])
    return cell, expected


def chi2_pvalue(seqs: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson chi-square of the chains' L-token sequences against the exact law; a sequence the
    law calls impossible rejects outright (p = 0)."""
    n = seqs.shape[0]
    counts = torch.bincount(sequence_index(seqs), minlength=law.numel()).double()
    cell, expected = merged_cells(law, n)
    if counts[cell < 0].sum() > 0:
        return 0.0
    observed = torch.zeros_like(expected).index_add_(0, cell[cell >= 0], counts[cell >= 0])
    dof = expected.numel() - 1
    if dof == 0:
        return 1.0
    stat = ((observed - n * expected) ** 2 / (n * expected)).sum()
    return torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0).item()


def chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    lo, hi = 0.0, 10.0 * dof + 200.0
    k = torch.tensor(dof / 2.0, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammaincc(k, torch.tensor(mid / 2, dtype=torch.float64)).item() > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def chi2_power(law: torch.Tensor, alternative: torch.Tensor, n: int, pilot_n: int | None = None) -> float:
    """Probability that chi2_pvalue rejects at ALPHA with n chains drawn from `alternative`: the
    noncentral chi-square's tail as a Poisson mixture of central ones. With `pilot_n`, the
    alternative is an empirical law from that many chains and its sampling noise is subtracted
    from the noncentrality. Mass on impossible sequences rejects by itself: 1 - (1 - m)^n."""
    cell, expected = merged_cells(law, n)
    alt = torch.zeros_like(expected).index_add_(0, cell[cell >= 0], alternative.double()[cell >= 0])
    impossible = float(alternative.double()[cell < 0].sum())
    distance = ((alt - expected) ** 2 / expected).sum().item()
    if pilot_n is not None:
        distance -= (alt * (1 - alt) / expected).sum().item() / pilot_n
    lam = max(n * distance, 0.0)
    dof = expected.numel() - 1
    c = chi2_critical(dof)
    half = lam / 2
    j = torch.arange(0, int(half + 12 * math.sqrt(half + 1) + 50), dtype=torch.float64)
    poisson = torch.exp(-half + j * math.log(max(half, 1e-300)) - torch.lgamma(j + 1))
    tails = torch.special.gammaincc((dof + 2 * j) / 2, torch.tensor(c / 2, dtype=torch.float64))
    power = min(float((poisson * tails).sum()), 1.0)
    return max(power, 1.0 - (1.0 - impossible) ** n)


def empirical_law(seqs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(sequence_index(seqs), minlength=V**L).double() / seqs.shape[0]


# ----------------------------------------------------------- E[tau | drafts], exactly


def expected_tau(rule: str, tables: Tables, contexts: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """E[tau | drafts] in float64 from the tables, written independently of the product code."""
    m, g1 = contexts.shape
    g = g1 - 1
    p = tables.p.double()[contexts]  # [m, g+1, V]
    x = contexts[:, 1:]
    if tables.one_hot:
        q = torch.nn.functional.one_hot(x, V).double()
    else:
        q = tables.q.double()[contexts[:, :g]]
    px = p[:, :g].gather(2, x.unsqueeze(2)).squeeze(2)
    qx = q.gather(2, x.unsqueeze(2)).squeeze(2)
    valid = torch.arange(g) < num.unsqueeze(1)
    if rule == "token":
        ratio = torch.where(qx > 0, px / qx.clamp_min(1e-300), (px > 0).double()).clamp(max=1.0)
        return torch.where(valid, ratio, 0.0).cumprod(dim=1).sum(dim=1)
    e = torch.zeros(m, dtype=torch.float64)
    w = torch.ones(m, dtype=torch.float64)
    hs = []
    for i in range(1, g + 1):
        w = torch.clamp(w * px[:, i - 1] / qx[:, i - 1].clamp_min(1e-300), max=1.0)
        if i < g:
            r = (w.unsqueeze(1) * p[:, i] - q[:, i]).clamp_min(0).sum(dim=1)
            den = r + 1 - w
            h_mid = torch.where(den > 0, r / den.clamp_min(1e-300), 1.0)
        else:
            h_mid = torch.zeros(m, dtype=torch.float64)
        hs.append(torch.where(i < num, h_mid, torch.where(i == num, w, 0.0)))
    h = torch.stack(hs, dim=1) if hs else torch.zeros(m, 0, dtype=torch.float64)
    # P(tau = i) = h_i prod_{j > i} (1 - h_j): the last passing index wins.
    for i in range(1, g + 1):
        e += i * h[:, i - 1] * (1 - h[:, i:]).prod(dim=1)
    return e


# ------------------------------------------- deliberately wrong variants (negative controls)


def WRONG_tokenwise_residual_from_previous_position(inp: VerifyInput) -> VerifyOutput:
    """Token-wise verification with an off-by-one: after rejecting X_{tau+1}, the correction is
    drawn from (p_tau - q_tau)+ (the previous position's tables) instead of (p_{tau+1} - q_{tau+1})+."""
    p, x, q, n = inp.target_probs, inp.draft_token_ids, inp.draft_probs, inp.num_drafts
    assert q is not None and bool((n == x.shape[1]).all())
    b, g = x.shape
    px = p[:, :g].gather(2, x.unsqueeze(2)).squeeze(2)
    qx = q.gather(2, x.unsqueeze(2)).squeeze(2)
    tau = ((torch.rand(b, g) * qx < px).to(torch.int64).cumprod(dim=1)).sum(dim=1)
    wrong = (tau - 1).clamp(min=0)  # the bug
    rows = torch.arange(b)
    residual = (p[rows, wrong] - q[rows, wrong.clamp(max=g - 1)]).clamp_min(0)
    use_p = (tau == n) | (residual.sum(1) <= 0)
    token = exponential_argmax(torch.where(use_p.unsqueeze(1), p[rows, tau], residual), {})
    column = torch.arange(g + 1)
    out = torch.where(column < tau.unsqueeze(1), torch.cat([x, x[:, :1]], 1), -1)
    out[rows, tau] = token
    return VerifyOutput(out, tau)


def WRONG_bonus_from_last_draft_position(verify: Verifier) -> Verifier:
    """The bonus token drawn from p_gamma instead of p_{gamma+1}: the row of p at num_drafts (read
    only for the bonus) is replaced by the row before it, then the product verifier runs."""

    def wrong(inp: VerifyInput) -> VerifyOutput:
        rows = torch.arange(inp.target_probs.shape[0])
        n = inp.num_drafts
        p = inp.target_probs.clone()
        p[rows, n] = inp.target_probs[rows, (n - 1).clamp(min=0)]
        return verify(replace(inp, target_probs=p))

    return wrong


class WRONG_position_keyed_uniforms:
    """Block verification whose uniforms are keyed only by (chain, draft position): the same
    eta_1..eta_gamma at every step of a chain. Installed over the product's uniform source."""

    def __init__(self, n: int, gamma: int, seed: int = 99) -> None:
        self.table = torch.rand(n, gamma, generator=torch.Generator().manual_seed(seed))
        self.active = torch.arange(n)

    def __call__(self, inp: VerifyInput) -> torch.Tensor:
        return self.table[self.active]


# -------------------------------------------------------------- 1. exact goodness of fit


@dataclass(frozen=True)
class Case:
    gamma: int
    tables: dict
    vary: bool = False  # num_drafts drawn in 0..gamma per row and step
    seeded: int = 0  # chains with their own generator
    n: int = N_CHAINS


GOF_CASES = {
    "gamma1_T1": Case(1, {}),
    "gamma3_T1_varying_num_drafts": Case(3, {}, vary=True),
    "gamma5_T0.3": Case(5, {"temperature": 0.3}),
    "gamma7_T1.7": Case(7, {"temperature": 1.7}),
    "gamma3_p_equals_q": Case(3, {"draft": "same"}),
    "gamma3_disjoint_supports": Case(3, {"draft": "disjoint"}),
    "gamma5_one_hot_q": Case(5, {"draft": "greedy"}),
    "gamma3_one_hot_q_T1.7_varying": Case(3, {"draft": "greedy", "temperature": 1.7}, vary=True),
    "gamma3_q_zero_where_p_positive": Case(3, {"draft": "zeros"}),
    "gamma5_top_k4": Case(5, {"top_k": 4}),
    "gamma3_top_p0.8_T1.7": Case(3, {"top_p": 0.8, "temperature": 1.7}),
    "gamma7_top_k5_top_p0.9_T0.3_varying": Case(7, {"top_k": 5, "top_p": 0.9, "temperature": 0.3}, vary=True),
    "gamma3_seeded_and_unseeded_rows": Case(3, {"seed": 1}, vary=True, seeded=30_000),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("name", list(GOF_CASES))
def test_emitted_sequences_follow_the_target_law_exactly(name: str, rule: str) -> None:
    case = GOF_CASES[name]
    tables = make_tables(**case.tables)
    law = exact_law(tables.p)
    run = run_chains(tables, case.gamma, case.n, RULES[rule], vary=case.vary, seeded=case.seeded)
    assert chi2_pvalue(run.seqs, law) > ALPHA
    if case.seeded:
        assert chi2_pvalue(run.seqs[: case.seeded], law) > ALPHA


# ----------------------------------------------------------------- 2. negative controls


PILOT_N = 100_000
SAMPLE_SIZES = (10_000, 20_000, 50_000, 100_000, 200_000, 300_000)
NEAR = make_tables()
CONTROLS: dict[str, tuple[Tables, Verifier]] = {
    "draft_sampled_at_T1.05_q_declared_at_T1_token": (make_tables(draft_temperature=1.05), verify_tokenwise),
    "draft_sampled_at_T1.05_q_declared_at_T1_block": (make_tables(draft_temperature=1.05), verify_block),
    "residual_from_the_previous_position": (NEAR, WRONG_tokenwise_residual_from_previous_position),
    "bonus_from_p_gamma_token": (NEAR, WRONG_bonus_from_last_draft_position(verify_tokenwise)),
    "bonus_from_p_gamma_block": (NEAR, WRONG_bonus_from_last_draft_position(verify_block)),
    "block_uniforms_keyed_by_position": (NEAR, verify_block),
}
CONTROL_GAMMA = 3


def _run_control(name: str, n: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    tables, verify = CONTROLS[name]
    on_step = None
    if name == "block_uniforms_keyed_by_position":
        keyed = WRONG_position_keyed_uniforms(n, CONTROL_GAMMA, seed=seed)
        monkeypatch.setattr(verify_module, "_uniforms", keyed)

        def on_step(active: torch.Tensor) -> None:
            keyed.active = active

    try:
        return run_chains(tables, CONTROL_GAMMA, n, verify, seed=seed, on_step=on_step).seqs
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("name", list(CONTROLS))
def test_negative_control_is_rejected(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    law = exact_law(CONTROLS[name][0].p)
    # A pilot run estimates the wrong variant's law; the sample size is the smallest whose power
    # to reject at ALPHA is >= 0.999; an independent run of that size must then be rejected.
    alternative = empirical_law(_run_control(name, PILOT_N, 1, monkeypatch))
    powers = {n: chi2_power(law, alternative, n, pilot_n=PILOT_N) for n in SAMPLE_SIZES}
    n = next((n for n, power in powers.items() if power >= 0.999), None)
    assert n is not None, f"no sample size reaches power 0.999: {powers}"
    assert chi2_pvalue(_run_control(name, n, 2, monkeypatch), law) < ALPHA


def test_negative_control_sample_sizes_are_not_trivially_large() -> None:
    """The harness is sensitive: a 5% temperature mismatch needs at most N_CHAINS chains."""
    tables, verify = CONTROLS["draft_sampled_at_T1.05_q_declared_at_T1_token"]
    alternative = empirical_law(run_chains(tables, CONTROL_GAMMA, PILOT_N, verify, seed=3).seqs)
    assert chi2_power(exact_law(tables.p), alternative, N_CHAINS, pilot_n=PILOT_N) >= 0.999


# ------------------------------------------------------------------- 3. acceptance law


LAW_CASES = {
    "gamma3_T1": (make_tables(), 3, False),
    "gamma5_top_k4_varying": (make_tables(top_k=4, seed=2), 5, True),
    "gamma4_one_hot_q_T1.7": (make_tables(draft="greedy", temperature=1.7), 4, False),
    "gamma3_q_zero_where_p_positive": (make_tables(draft="zeros", seed=3), 3, False),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("name", list(LAW_CASES))
def test_accepted_count_matches_its_conditional_expectation(name: str, rule: str) -> None:
    tables, gamma, vary = LAW_CASES[name]
    run = run_chains(tables, gamma, 100_000, RULES[rule], vary=vary, law=rule)
    diff = torch.cat(run.taus).double() - torch.cat(run.expected)
    z = diff.mean() / (diff.std() / math.sqrt(diff.numel()))
    assert abs(float(z)) < 5.0, f"mean(tau - E[tau | X]) = {float(diff.mean()):.2e} (z = {float(z):.1f})"
    if rule == "block" and gamma > 1 and not tables.one_hot:
        # Block verification accepts measurably more than the token-wise law predicts, draft by draft
        # (with one-hot q both reach the bound P(tau >= i) <= prod_j p_j(X_j), so they are equal).
        token_law = [expected_tau("token", tables, contexts, num) for contexts, num in run.drafts]
        more = torch.cat(run.taus).double() - torch.cat(token_law)
        assert float(more.mean()) > 5.0 * float(more.std()) / math.sqrt(more.numel())


def all_draft_blocks(tables: Tables, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (context, X_1..X_gamma) with its draft probability prod_i q(X_i | X_{i-1})."""
    grids = torch.cartesian_prod(*[torch.arange(V)] * (gamma + 1))  # [V^(gamma+1), gamma+1]
    q = tables.q_draw.double()
    prob = torch.ones(grids.shape[0], dtype=torch.float64)
    for i in range(gamma):
        prob *= q[grids[:, i], grids[:, i + 1]]
    return grids, prob


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize(
    "tables", [{}, {"top_k": 4}, {"draft": "zeros"}, {"temperature": 1.7, "seed": 5}, {"draft": "greedy"}],
    ids=["T1", "top_k4", "q_zeros", "T1.7", "one_hot_q"],
)
def test_block_expected_acceptance_is_never_below_tokenwise(gamma: int, tables: dict) -> None:
    t = make_tables(**tables)
    contexts, prob = all_draft_blocks(t, gamma)
    num = torch.full((contexts.shape[0],), gamma)
    by_context = {}
    for rule in RULES:
        e = expected_tau(rule, t, contexts, num) * prob
        by_context[rule] = torch.zeros(V, dtype=torch.float64).index_add_(0, contexts[:, 0], e)
    token, block = by_context["token"], by_context["block"]
    assert (block >= token - 1e-12).all()
    if gamma == 1:
        torch.testing.assert_close(block, token, rtol=0, atol=1e-12)
    elif not t.one_hot:
        assert (block > token + 1e-4).any()


def test_tokenwise_expectation_matches_the_closed_form() -> None:
    """Context-independent tables: E[tau] = sum_{i=1..gamma} alpha^i, alpha = sum min(p, q), so
    tokens per step = (1 - alpha^(gamma+1)) / (1 - alpha) as SPEC-DECODING.md states."""
    t = make_tables()
    flat = Tables(p=t.p[[2] * V], q=t.q[[2] * V], q_draw=t.q[[2] * V], one_hot=False)
    gamma = 4
    contexts, prob = all_draft_blocks(flat, gamma)
    e = (expected_tau("token", flat, contexts, torch.full((contexts.shape[0],), gamma)) * prob).sum() / V
    alpha = torch.minimum(t.p[2], t.q[2]).double().sum()
    torch.testing.assert_close(e + 1, (1 - alpha ** (gamma + 1)) / (1 - alpha), rtol=1e-6, atol=0)  # float32 tables


# ----------------------------------------------------------------------------- 4. greedy


def argmax_chain(p: torch.Tensor) -> torch.Tensor:
    """What decoding without speculation gives at temperature 0: s_k = argmax p(. | s_{k-1})."""
    chain, last = [], START
    for _ in range(L):
        last = int(p[last].argmax())
        chain.append(last)
    return torch.tensor(chain)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("draft", ["near", "greedy"])
def test_temperature_zero_gives_exactly_the_argmax_chain(rule: str, draft: str) -> None:
    # Tables processed at temperature 0 are one-hot at the argmax, as processed_probs gives them.
    tables = make_tables(draft=draft, temperature=0.0, seed=4)
    assert torch.equal(tables.p.sum(dim=1), torch.ones(V)) and torch.equal(tables.p.amax(dim=1), torch.ones(V))
    run = run_chains(tables, 5, 2_000, RULES[rule], vary=True, greedy=2_000)
    assert (run.seqs == argmax_chain(tables.p)).all()


@pytest.mark.parametrize("rule", list(RULES))
def test_mixed_greedy_and_random_rows_in_one_batch(rule: str) -> None:
    """Half the chains are greedy rows over soft (temperature-1) tables: they must follow the
    argmax chain exactly; the random half (some seeded) must still follow the target law."""
    tables = make_tables(seed=6)
    n = 200_000
    run = run_chains(tables, 4, n, RULES[rule], vary=True, seeded=5_000, greedy=n // 2)
    assert (run.seqs[n // 2 :] == argmax_chain(tables.p)).all()
    assert chi2_pvalue(run.seqs[: n // 2], exact_law(tables.p)) > ALPHA


def _random_batch(b: int, g: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(b, g + 1, v, generator=gen), dim=-1)
    q = torch.softmax(2 * torch.randn(b, g, v, generator=gen), dim=-1)
    # Drafts that often agree with the target's argmax, so greedy rows accept several.
    agree = torch.rand(b, g, generator=gen) < 0.7
    x = torch.where(agree, p[:, :g].argmax(-1), torch.randint(0, v, (b, g), generator=gen))
    num = torch.randint(0, g + 1, (b,), generator=gen)
    return p, q, x, num


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dense_q", [True, False])
def test_greedy_rows_accept_while_the_draft_is_the_argmax(rule: str, dense_q: bool) -> None:
    b, g, v = 300, 4, 12
    p, q, x, num = _random_batch(b, g, v, seed=7)
    greedy = torch.arange(b) % 3 != 0
    out = RULES[rule](VerifyInput(p, x, q if dense_q else None, num, greedy, {5: torch.Generator().manual_seed(1)}))
    for row in greedy.nonzero().squeeze(1).tolist():
        tau = 0
        while tau < num[row] and x[row, tau] == p[row, tau].argmax():
            tau += 1
        expected = x[row, :tau].tolist() + [int(p[row, tau].argmax())] + [-1] * (g - tau)
        assert out.num_accepted[row] == tau
        assert out.output_token_ids[row].tolist() == expected


def test_argmax_verification_equals_the_greedy_rows_of_both_rules() -> None:
    """verify_greedy on the targets' argmax ids is what either rule does for greedy rows."""
    b, g, v = 300, 4, 12
    p, _, x, num = _random_batch(b, g, v, seed=11)
    fast = verify_greedy(p.argmax(-1), x, num)
    greedy = torch.ones(b, dtype=torch.bool)
    for rule in RULES.values():
        full = rule(VerifyInput(p, x, None, num, greedy, {}))
        assert torch.equal(fast.output_token_ids, full.output_token_ids)
        assert torch.equal(fast.num_accepted, full.num_accepted)


def test_accept_all_takes_every_draft_then_the_argmax_after_it() -> None:
    p, _, x, num = _random_batch(50, 4, 12, seed=12)
    out = accept_all(p.argmax(-1), x, num)
    assert torch.equal(out.num_accepted, num)
    for row in range(50):
        n = int(num[row])
        assert out.output_token_ids[row].tolist() == x[row, :n].tolist() + [int(p[row, n].argmax())] + [-1] * (4 - n)


@pytest.mark.parametrize("length", [1.0, 1.5, 2.25, 3.5, 4.0, 5.2])
def test_benchmark_pattern_has_the_asked_mean_acceptance_length(length: float) -> None:
    """The fixed pattern accepts floor(length - 1) or one more at each step, and after any number
    of steps its total is the running total's whole part: the mean converges at 1/steps."""
    accepted = [benchmark_accepted(length, step) for step in range(400)]
    assert set(accepted) <= {math.floor(length - 1), math.ceil(length - 1)}
    for steps in (1, 2, 7, 400):
        assert sum(accepted[:steps]) == math.floor(steps * (length - 1) + 1e-9)
    assert [benchmark_accepted(3.5, step) for step in range(4)] == [2, 3, 2, 3]


# ----------------------------------------------------------------- 5. no host sync


def _forbid(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_host_reads(monkeypatch, "verification")


@pytest.mark.parametrize("rule", list(RULES))
def test_verify_never_reads_tensor_values_on_host(monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    b, g, v = 6, 4, 10
    _, q, x, _ = _random_batch(b, g, v, seed=8)
    num = torch.tensor([0, 1, 2, 3, 4, 4])
    logits = torch.randn(b * (g + 1), v)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0 if r % 3 == 0 else 0.8, top_k=6, top_p=0.9), [1], [2], None)
        for r in range(b * (g + 1))
    ]
    metadata = SamplingMetadata.build(rows, v, CPU)
    greedy = torch.tensor([True, False, False, True, False, False])
    _forbid(monkeypatch)
    with pytest.raises(AssertionError, match="host synchronisation"):
        torch.zeros(1).item()  # the patch is live
    p = processed_probs(logits, metadata).view(b, g + 1, v)
    outs = [
        RULES[rule](VerifyInput(p, x, q, num, greedy, {2: torch.Generator().manual_seed(3)})),
        RULES[rule](VerifyInput(p, x, None, num, None, {})),
        RULES[rule](VerifyInput(p[:, :1], x[:, :0], None, torch.zeros(b, dtype=torch.int64), greedy, {})),
    ]
    monkeypatch.undo()
    for out, width in zip(outs, (g + 1, g + 1, 1)):
        assert out.output_token_ids.shape == (b, width) and out.num_accepted.shape == (b,)
        assert (out.num_accepted <= num).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", list(RULES))
def test_verify_does_not_synchronise_on_cuda(rule: str) -> None:
    device = torch.device("cuda")
    p, q, x, num = (t.to(device) for t in _random_batch(64, 4, 32_000, seed=9))
    generator = torch.Generator(device=device).manual_seed(0)
    greedy = (torch.arange(64) % 4 == 0).to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dense = RULES[rule](VerifyInput(p, x, q, num, greedy, {3: generator}))
        one_hot = RULES[rule](VerifyInput(p, x, None, num, None, {}))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert dense.output_token_ids.device.type == "cuda" and one_hot.num_accepted.device.type == "cuda"
    assert (dense.num_accepted <= num).all() and (one_hot.num_accepted <= num).all()


# ---------------------------------------------------------------------- invariants


@pytest.mark.parametrize("rule", list(RULES))
def test_seeded_rows_reproduce_and_randomness_is_fresh_each_call(rule: str) -> None:
    """A seeded row's draws come only from its generator, in an amount that does not depend on
    its neighbours or the batch's padded width; successive calls draw fresh values."""
    v = 50
    p, q, x, _ = _random_batch(1, 3, v, seed=10)
    p = torch.softmax(0.3 * torch.randn(1, 4, v, generator=torch.Generator().manual_seed(1)), dim=-1)  # flat

    def calls(batch: int, width: int, row: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(1234)
        pad = width - 3
        pp = torch.cat([p, torch.full((1, pad, v), float("nan"))], dim=1).expand(batch, -1, -1)
        qq = torch.cat([q, torch.full((1, pad, v), float("nan"))], dim=1).expand(batch, -1, -1)
        xx = torch.cat([x, torch.full((1, pad), -1)], dim=1).expand(batch, -1)
        num = torch.full((batch,), 3)
        return [
            RULES[rule](VerifyInput(pp, xx, qq, num, None, {row: generator})).output_token_ids[row, :4].tolist()
            for _ in range(12)
        ]

    alone = calls(1, 3, 0)
    assert alone == calls(5, 3, 2) == calls(4, 7, 3)
    assert len({tuple(step) for step in alone}) > 3  # fresh draws on every call


@pytest.mark.parametrize("rule", list(RULES))
def test_residual_without_mass_falls_back_to_p(rule: str) -> None:
    """A declared q that dominates p everywhere (not normalised, as round-off can make it) leaves
    (p - q)+ empty after a rejection: the correction comes from p at that position instead."""
    n, v = 60_000, 6
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0]).expand(n, 2, v)
    q = torch.tensor([0.6, 0.6, 0.1, 0.1, 0.1, 0.1]).expand(n, 1, v)
    x = torch.zeros(n, 1, dtype=torch.int64)
    torch.manual_seed(11)
    out = RULES[rule](VerifyInput(p.contiguous(), x, q.contiguous(), torch.ones(n, dtype=torch.int64), None, {}))
    rejected = out.num_accepted == 0
    assert abs(float(rejected.double().mean()) - 1 / 6) < 0.01  # accept iff U * 0.6 < 0.5
    corrections = out.output_token_ids[rejected, 0]
    assert ((corrections == 0) | (corrections == 1)).all()
    assert abs(float((corrections == 1).double().mean()) - 0.5) < 0.03


def test_bad_shapes_are_refused() -> None:
    p, q, x, num = _random_batch(3, 2, 5, seed=12)
    with pytest.raises(ValueError, match="G\\+1"):
        verify_tokenwise(VerifyInput(p[:, :2], x, q, num, None, {}))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(VerifyInput(p, x, q[:, :1], num, None, {}))
    with pytest.raises(ValueError, match="num_drafts"):
        verify_block(VerifyInput(p, x, q, num[:2], None, {}))

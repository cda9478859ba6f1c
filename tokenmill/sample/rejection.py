"""Verification of speculative drafts for a whole batch in one call, without host synchronisation.

Token-wise rejection sampling (Leviathan et al. 2023; Chen et al. 2023) and block verification
(Sun et al., arXiv 2403.10444), exactly as ../shared/SPEC-DECODING.md states them; both emit
tokens distributed exactly as the target's processed distributions p.

Layout (B requests, G = the batch's padded draft width, V = vocabulary):
  target_probs [B, G+1, V]: p_1..p_{G+1}; row b uses p_1..p_{n_b+1} (n_b = num_drafts[b]) and
                            ignores the rest, whatever they hold (NaN included).
  draft_token_ids [B, G], draft_probs [B, G, V]: positions i >= n_b are padding, never read
                            for their value.
  output_token_ids [B, G+1]: the tau accepted drafts, then one correction/bonus token, then -1.

Invariants:
- Acceptance tests use strict `<` against U ~ U[0, 1): a draft with p(x) = 0 is never accepted and
  an h = 1 (or p >= q) test always passes; otherwise identical in law to the spec's `<=`.
- A residual with (numerically) no mass, at most _MIN_RESIDUAL_MASS, falls back to p at that
  position. In exact arithmetic a residual is only reached with positive mass (token-wise:
  P(reject) = sum (p - q)+; block: h_i > 0 needs r_i > 0, and r_i = 0 with w_i = 1 makes every later
  test pass), so the fallback only absorbs float32 round-off and moves the output law by at most
  that mass.
- Randomness is fresh on every call: the global RNG, or the row's generator. A seeded row draws,
  in this order, max(G, 32) uniforms and then V exponentials per call, so its stream does not
  depend on the batch's padded width G (up to 32) or on its neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tokenmill.sample.sampler import exponential_argmax

_MIN_RESIDUAL_MASS = 1e-8
_SEEDED_UNIFORMS = 32


@dataclass
class VerifyInput:
    target_probs: torch.Tensor  # [B, G+1, V] float32 processed target distributions p_1..p_{G+1}
    draft_token_ids: torch.Tensor  # [B, G] int64 (padding where i >= num_drafts[b])
    draft_probs: torch.Tensor | None  # [B, G, V] q_i exactly as sampled; None = one-hot q
    num_drafts: torch.Tensor  # [B] int64 in 0..G
    greedy: torch.Tensor | None = None  # [B] bool: temperature-0 rows (argmax semantics)
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # per-row seeded RNG


@dataclass
class VerifyOutput:
    output_token_ids: torch.Tensor  # [B, G+1] int64: accepted drafts, correction/bonus, -1 after
    num_accepted: torch.Tensor  # [B] int64 tau; the row emits tau + 1 tokens


@dataclass
class _Prepared:
    p: torch.Tensor  # [B, G+1, V]
    x: torch.Tensor  # [B, G] draft ids, padding replaced by 0
    valid: torch.Tensor  # [B, G] bool: i < num_drafts
    px: torch.Tensor  # [B, G] p_i(X_i)
    qx: torch.Tensor  # [B, G] q_i(X_i) (1 for one-hot q)


def verify_tokenwise(inp: VerifyInput) -> VerifyOutput:
    """Accept X_i iff U_i q_i(X_i) < p_i(X_i), stop at the first rejection; then a token from
    (p_{tau+1} - q_{tau+1})+ or, when every draft was accepted, the bonus from p_{n+1}."""
    prep = _prepare(inp)
    u = _uniforms(inp)
    accept = (u * prep.qx < prep.px) & prep.valid
    tau = _leading_true(accept)
    return _finish(inp, prep, tau, None)


def verify_block(inp: VerifyInput) -> VerifyOutput:
    """Block verification: weights w_i, pass probabilities h_i, tau = the LAST i with eta_i < h_i,
    then a token from (w_tau p_{tau+1} - q_{tau+1})+ or the bonus from p_{n+1}."""
    prep = _prepare(inp)
    b, g = prep.x.shape
    eta = _uniforms(inp)
    if g == 0:
        return _finish(inp, prep, torch.zeros(b, dtype=torch.int64, device=prep.x.device), None)
    # w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i)); q(X) = 0 < p(X) gives a huge finite ratio.
    ratio = prep.px / prep.qx.clamp_min(torch.finfo(torch.float32).tiny)
    weights = []
    w = torch.ones(b, dtype=torch.float32, device=ratio.device)
    for i in range(g):
        w = torch.clamp_max(w * ratio[:, i], 1.0)
        weights.append(w)
    w_all = torch.stack(weights, dim=1)  # [B, G]: w_1..w_G
    # r_i = sum_x (w_i p_{i+1}(x) - q_{i+1}(x))+ for i = 1..G-1 (0-indexed rows 1..G-1 of p and q).
    w_mid = w_all[:, : g - 1]
    p_next = prep.p[:, 1:g]
    if inp.draft_probs is None:
        x_next = prep.x[:, 1:g].unsqueeze(-1)
        others = p_next.scatter(-1, x_next, 0.0).sum(-1)
        r = w_mid * others + (w_mid * prep.px[:, 1:g] - 1.0).clamp_min(0.0)
    else:
        r = (w_mid.unsqueeze(-1) * p_next - inp.draft_probs[:, 1:g]).clamp_min(0.0).sum(-1)
    den = r + (1.0 - w_mid)
    h_mid = torch.where(den > 0, r / torch.where(den > 0, den, 1.0), 1.0)
    h_mid = torch.cat([h_mid, w_all.new_zeros(b, 1)], dim=1)  # [B, G]
    n = inp.num_drafts.unsqueeze(1)
    position = torch.arange(1, g + 1, device=n.device).unsqueeze(0)  # i = 1..G
    h = torch.where(position < n, h_mid, torch.where(position == n, w_all, 0.0))
    passed = (eta < h) & prep.valid
    tau = (passed.to(torch.int64) * position).amax(dim=1)
    w_tau = torch.cat([w_all.new_ones(b, 1), w_all], dim=1).gather(1, tau.unsqueeze(1))
    return _finish(inp, prep, tau, w_tau)


def verify_greedy(target_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor) -> VerifyOutput:
    """Every row greedy, nothing applied before the argmax: accept drafts while they equal the
    target's argmax, then emit the target's argmax at the first mismatch (or the bonus position).
    target_ids [B, G+1]: the argmax of each target row; the rest as in VerifyInput."""
    g = draft_token_ids.shape[1]
    valid = torch.arange(g, device=target_ids.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    tau = _argmax_run(draft_token_ids, target_ids, valid)
    return _emit(draft_token_ids, tau, target_ids.gather(1, tau.unsqueeze(1)).squeeze(1))


def accept_all(target_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor) -> VerifyOutput:
    """BENCHMARK-ONLY (config refuses it without an explicit opt-in; not lossless): every draft is
    accepted and the bonus token is the target's argmax after the last one."""
    return _emit(draft_token_ids, num_drafts, target_ids.gather(1, num_drafts.unsqueeze(1)).squeeze(1))


def benchmark_accepted(length: float, step: int) -> int:
    """BENCHMARK-ONLY: drafts accepted at a request's verify step `step` (0, 1, ...) so that the
    mean acceptance length (accepted + 1) over its steps is `length`: the whole steps of the
    running total (length - 1) * steps, e.g. 2, 3, 2, 3, ... for 3.5."""
    return math.floor((step + 1) * (length - 1) + 1e-9) - math.floor(step * (length - 1) + 1e-9)


# ------------------------------------------------------------------------------ internals


def _prepare(inp: VerifyInput) -> _Prepared:
    p, x, n = inp.target_probs, inp.draft_token_ids, inp.num_drafts
    if p.dim() != 3 or x.dim() != 2 or p.shape[0] != x.shape[0] or p.shape[1] != x.shape[1] + 1:
        raise ValueError(
            f"target_probs {tuple(p.shape)} must be [B, G+1, V] for draft_token_ids {tuple(x.shape)} [B, G]"
        )
    b, g = x.shape
    if n.shape != (b,):
        raise ValueError(f"num_drafts {tuple(n.shape)} must be [{b}]")
    if inp.draft_probs is not None and inp.draft_probs.shape != (b, g, p.shape[2]):
        raise ValueError(f"draft_probs {tuple(inp.draft_probs.shape)} must be [{b}, {g}, {p.shape[2]}]")
    if inp.greedy is not None and inp.greedy.shape != (b,):
        raise ValueError(f"greedy {tuple(inp.greedy.shape)} must be [{b}]")
    valid = torch.arange(g, device=x.device).unsqueeze(0) < n.unsqueeze(1)
    x = torch.where(valid, x, 0)
    index = x.unsqueeze(-1)
    px = p[:, :g].gather(-1, index).squeeze(-1)
    if inp.draft_probs is None:
        qx = torch.ones_like(px)
    else:
        qx = inp.draft_probs.gather(-1, index).squeeze(-1)
    return _Prepared(p=p, x=x, valid=valid, px=px, qx=qx)


def _uniforms(inp: VerifyInput) -> torch.Tensor:
    """[B, G] U(0, 1): the global RNG, except rows with a generator (see the module invariants)."""
    b, g = inp.draft_token_ids.shape
    device = inp.target_probs.device
    u = torch.empty(b, g, dtype=torch.float32, device=device)
    if len(inp.generators) < b:
        u.uniform_()
    width = max(g, _SEEDED_UNIFORMS)
    for row, generator in inp.generators.items():
        u[row] = torch.rand(width, generator=generator, device=device)[:g]
    return u


def _argmax_run(drafts: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] greedy acceptance: how many leading drafts equal the target's argmax at their position
    (target_ids [B, >= G]; valid [B, G] marks real drafts)."""
    return _leading_true((drafts == target_ids[:, : drafts.shape[1]]) & valid)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, G] bool -> [B] int64 number of leading True values."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _finish(inp: VerifyInput, prep: _Prepared, tau: torch.Tensor, w_tau: torch.Tensor | None) -> VerifyOutput:
    """Greedy override, then the correction (residual) or bonus token at position tau."""
    p, x = prep.p, prep.x
    b, g = x.shape
    v = p.shape[2]
    if inp.greedy is not None and g > 0:
        tau = torch.where(inp.greedy, _argmax_run(x, p[:, :g].argmax(dim=-1), prep.valid), tau)
    p_sel = p.gather(1, tau.view(b, 1, 1).expand(b, 1, v)).squeeze(1)  # p_{tau+1}: [B, V]
    bonus = tau >= inp.num_drafts
    if g == 0:
        dist = p_sel.clone()
    else:
        at = tau.clamp(max=g - 1)
        resid = p_sel if w_tau is None else p_sel * w_tau
        if inp.draft_probs is None:
            x_sel = x.gather(1, at.unsqueeze(1))  # one-hot q at X_{tau+1}
            resid = resid.scatter(1, x_sel, (resid.gather(1, x_sel) - 1.0).clamp_min(0.0))
        else:
            q_sel = inp.draft_probs.gather(1, at.view(b, 1, 1).expand(b, 1, v)).squeeze(1)
            resid = (resid - q_sel).clamp_min(0.0)
        empty = ~(resid.sum(dim=-1) > _MIN_RESIDUAL_MASS)  # NaN padding counts as empty
        dist = torch.where((bonus | empty).unsqueeze(1), p_sel, resid)
    token = exponential_argmax(dist, inp.generators)
    if inp.greedy is not None:
        token = torch.where(inp.greedy, p_sel.argmax(dim=-1), token)
    return _emit(x, tau, token)


def _emit(drafts: torch.Tensor, tau: torch.Tensor, token: torch.Tensor) -> VerifyOutput:
    """[B, G+1] rows: the tau accepted drafts, `token`, then -1."""
    b, g = drafts.shape
    column = torch.arange(g + 1, device=drafts.device).unsqueeze(0)
    padded = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)
    t = tau.unsqueeze(1)
    out = torch.where(column < t, padded, torch.where(column == t, token.unsqueeze(1), -1))
    return VerifyOutput(output_token_ids=out, num_accepted=tau)

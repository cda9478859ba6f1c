"""The routing kernel against select_experts_ref: every router kind, exact ids (order included)
and ties broken towards the lower index, as the reference's stable sort does.

Logits lie on a grid of 1/8 so that distinct choices differ by far more than a rounding of exp
or sigmoid, and equal ones (ties) are common: which expert wins then is the rule under test."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.layers.moe.routing import RoutingConfig, select_experts, select_experts_ref

SMALL = {
    "softmax": RoutingConfig(8, 2),
    "softmax-renorm-ragged-experts": RoutingConfig(12, 4, renormalize=True),
    "sigmoid-bias-top2-groups": RoutingConfig(16, 3, "sigmoid", True, 4, 2, "top2_sum", True, 2.5),
    "softmax-max-groups-of-3": RoutingConfig(12, 3, "softmax", False, 4, 2, "max", False, 1.5),
    "sigmoid-bias-ungrouped": RoutingConfig(10, 3, "sigmoid", False, has_correction_bias=True),
}
REAL = {
    "qwen3-30b-a3b": RoutingConfig(128, 8, renormalize=True),
    "deepseek-v3": RoutingConfig(256, 8, "sigmoid", True, 8, 4, "top2_sum", True, 2.5),
    "deepseek-v2": RoutingConfig(160, 6, "softmax", False, 8, 3, "max", False, 16.0),
    "qwen3-next": RoutingConfig(512, 10, renormalize=True),
}


def _logits(tokens: int, cfg: RoutingConfig, device: str, spread: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-spread, spread + 1, (tokens, cfg.num_experts), generator=gen).float() / 8
    bias = torch.randint(-8, 9, (cfg.num_experts,), generator=gen).float() / 64 if cfg.has_correction_bias else None
    return logits.to(device), None if bias is None else bias.to(device)


def _check(cfg: RoutingConfig, tokens: int, device: str, spread: int, seed: int) -> None:
    logits, bias = _logits(tokens, cfg, device, spread, seed)
    weights, ids = select_experts(logits, cfg, bias, use_triton=True)
    ref_weights, ref_ids = select_experts_ref(logits.cpu(), cfg, None if bias is None else bias.cpu())
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (tokens, cfg.top_k)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,device", [on_cpu(n, id=n) for n in SMALL] + [on_gpu(n, id=n) for n in REAL])
def test_routing_kernel_matches_reference(name: str, device: str) -> None:
    cfg = SMALL.get(name) or REAL[name]
    _check(cfg, 11 if device == "cpu" else 2048, device, spread=24, seed=0)


@pytest.mark.parametrize("name,device", [on_cpu(n, id=n) for n in ("softmax-renorm-ragged-experts", "sigmoid-bias-top2-groups",
                                                                  "softmax-max-groups-of-3")]
                         + [on_gpu(n, id=n) for n in REAL])
def test_routing_kernel_breaks_ties_towards_the_lower_index(name: str, device: str) -> None:
    """Logits of three values only: most choices and group scores tie."""
    cfg = SMALL.get(name) or REAL[name]
    _check(cfg, 9 if device == "cpu" else 512, device, spread=1, seed=1)


def test_reference_breaks_ties_towards_the_lower_index() -> None:
    cfg = RoutingConfig(8, 3, "softmax", False, 4, 2, "max", False)
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    # every group's best is 1.0: groups 0 and 1 are kept, then experts 1, 3 win (and 2, 0 tie at 0.0)
    assert select_experts_ref(logits, cfg)[1].tolist() == [[1, 3, 0]]

"""Expert selection: router logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]).

One rule covers every router tokenmill runs (transformers' implementations are the oracle):

1. scores = softmax(logits) or sigmoid(logits), in float32.
2. choice = scores + e_score_correction_bias (where the router has one; the bias only steers
   selection, the weights come from the unbiased scores).
3. Group-limited selection (n_group > 1 and topk_group < n_group): the experts are split into
   n_group consecutive groups; each group scores max(choice) ("max": DeepSeek-V2's
   group_limited_greedy) or the sum of its two best choices ("top2_sum": DeepSeek-V3's and
   Kimi-Linear's noaux_tc); only the best topk_group groups stay eligible.
4. The k best eligible choices are the experts; their weights are their scores, divided by the
   weights' sum if renormalize (norm_topk_prob; + 1e-20, below float32's resolution of any sum
   of k scores), then times routed_scaling_factor.

Ties are broken deterministically, the same way on every path: among equal choices (or equal
group scores) the lowest expert (or group) index wins. The weights and ids come out ordered by
choice, best first.

`select_experts` runs the Triton kernel (tokenmill/kernels/moe/routing.py) on CUDA, with no host
sync, and the reference below elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PretrainedConfig

from tokenmill.errors import ConfigError

Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: GroupScore = "max"
    has_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    float32_logits: bool = False
    """The router matmul runs in float32 (DeepSeek, Kimi) rather than in the model's dtype (Qwen)."""

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"router scoring {self.scoring!r} is not supported: use 'softmax' or 'sigmoid'")
        if self.group_score not in ("max", "top2_sum"):
            raise ConfigError(f"group score {self.group_score!r} is not supported: use 'max' or 'top2_sum'")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok = {self.top_k} must be between 1 and num_experts = {self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(f"n_group = {self.n_group} must divide num_experts = {self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group = {self.topk_group} must be between 1 and n_group = {self.n_group}")
        if self.grouped:
            eligible = self.topk_group * self.group_size
            if self.top_k > eligible:
                raise ConfigError(f"top_k = {self.top_k} exceeds the {eligible} experts of topk_group = "
                                  f"{self.topk_group} groups of {self.group_size}: raise topk_group")
            if self.group_score == "top2_sum" and self.group_size < 2:
                raise ConfigError("group score 'top2_sum' needs groups of at least two experts: lower n_group")

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group

    @property
    def grouped(self) -> bool:
        """Whether group-limited selection can exclude any expert."""
        return self.n_group > 1 and self.topk_group < self.n_group

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> RoutingConfig:
        """The routing of a Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen4Exp, DeepSeek-V2, DeepSeek-V3,
        Kimi-Linear or Raon-style config."""
        family = _FAMILIES.get(getattr(config, "model_type", None))
        if family is None:
            raise ConfigError(f"no MoE routing is known for model_type {getattr(config, 'model_type', None)!r}; "
                              f"supported: {', '.join(sorted(_FAMILIES))}")
        num_experts = _first(config, "n_routed_experts", "num_experts", "num_local_experts")
        top_k = _first(config, "num_experts_per_tok", "num_experts_per_token")
        if num_experts is None or top_k is None:
            raise ConfigError(f"{config.model_type}: the config names no expert count or experts per token")
        scoring = _first(config, "scoring_func", "moe_router_activation_func") or family.scoring
        if scoring != family.scoring:
            raise ConfigError(f"{config.model_type} routers score with {family.scoring}; the config asks for {scoring!r}")
        method = getattr(config, "topk_method", None) or family.topk_method
        if method not in family.topk_methods:
            raise ConfigError(f"{config.model_type}: topk_method {method!r} is not supported; "
                              f"use one of {', '.join(family.topk_methods)}")
        renormalize = family.renormalize
        if renormalize is None:
            renormalize = bool(_first(config, "norm_topk_prob", "moe_renormalize") or False)
        if renormalize and not family.honours_norm_topk_prob:
            raise ConfigError(f"{config.model_type} with norm_topk_prob = true is routed differently by transformers "
                              "(which ignores it) and the original code (which then skips routed_scaling_factor); "
                              "set norm_topk_prob = false")
        grouped = method in ("group_limited_greedy", "noaux_tc")
        n_group = (_first(config, "n_group", "num_expert_group") or 1) if grouped else 1
        topk_group = (getattr(config, "topk_group", None) or n_group) if grouped else 1
        return cls(
            num_experts=int(num_experts),
            top_k=int(top_k),
            scoring=scoring,
            renormalize=renormalize,
            n_group=int(n_group),
            topk_group=int(topk_group),
            group_score="top2_sum" if method == "noaux_tc" else "max",
            has_correction_bias=method == "noaux_tc",
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            float32_logits=family.float32_logits,
        )


@dataclass(frozen=True)
class _Family:
    """What a family's transformers router fixes whatever its config says."""

    scoring: Scoring
    topk_methods: tuple[str, ...]
    topk_method: str  # when the config names none
    honours_norm_topk_prob: bool = True
    float32_logits: bool = False
    renormalize: bool | None = None  # fixed whatever the config says (None: the config's norm_topk_prob)


_QWEN = _Family("softmax", ("greedy",), "greedy")
_FAMILIES: dict[str | None, _Family] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "qwen3_next": _QWEN,
    "qwen4_exp_text": _QWEN,
    "qwen3_5_moe_text": _Family("softmax", ("greedy",), "greedy", renormalize=True),  # its router always renormalises
    "deepseek_v2": _Family("softmax", ("greedy", "group_limited_greedy"), "greedy", honours_norm_topk_prob=False,
                           float32_logits=True),
    "deepseek_v3": _Family("sigmoid", ("noaux_tc",), "noaux_tc", float32_logits=True),
    "kimi_linear": _Family("sigmoid", ("noaux_tc",), "noaux_tc", float32_logits=True),
    "raon": _Family("sigmoid", ("noaux_tc",), "noaux_tc", float32_logits=True),  # Kimi-Linear's router (models/raon.py)
}


def _first(config: PretrainedConfig, *names: str) -> object:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def select_experts(
    router_logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]) for router_logits [T, E]. use_triton
    (default: on CUDA) runs the Triton kernel; otherwise the PyTorch reference."""
    _check(router_logits, cfg, correction_bias)
    if use_triton if use_triton is not None else router_logits.is_cuda:
        from tokenmill.kernels.moe.routing import route

        return route(
            router_logits, correction_bias, top_k=cfg.top_k, sigmoid=cfg.scoring == "sigmoid", renormalize=cfg.renormalize,
            n_group=cfg.n_group if cfg.grouped else 1, topk_group=cfg.topk_group if cfg.grouped else 1,
            top2_group_score=cfg.group_score == "top2_sum", scale=cfg.routed_scaling_factor,
        )
    return select_experts_ref(router_logits, cfg, correction_bias)


def _check(router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None) -> None:
    if router_logits.dim() != 2 or router_logits.shape[1] != cfg.num_experts:
        raise ValueError(f"router logits must be [T, {cfg.num_experts}], got {tuple(router_logits.shape)}")
    if (correction_bias is not None) != cfg.has_correction_bias:
        raise ValueError("a correction bias is required exactly when the routing config has one")
    if correction_bias is not None and correction_bias.shape != (cfg.num_experts,):
        raise ValueError(f"correction bias must be [{cfg.num_experts}], got {tuple(correction_bias.shape)}")


def select_experts_ref(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: float32 torch ops; stable sorts give the lowest index among ties."""
    _check(router_logits, cfg, correction_bias)
    logits = router_logits.float()
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.grouped:
        groups = choice.view(-1, cfg.n_group, cfg.group_size)
        if cfg.group_score == "max":
            group_scores = groups.max(dim=-1).values
        else:
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        kept = _stable_topk(group_scores, cfg.topk_group)
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(cfg.group_size, dim=1), float("-inf"))
    ids = _stable_topk(choice, cfg.top_k)
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids.to(torch.int32)


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, best first, the lower index first among equals."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]

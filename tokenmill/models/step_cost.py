"""A step's cost at depth, from the model's shape: the context depth at which one prefill token's
attention FLOPs equal its linear layers' FLOPs (the scheduler's step-cost rule,
SchedulerConfig.prefill_attention_depth, takes its default from here), and whether a step's
memory grows with the depth of its keys (the memory profile then runs a step at max_model_len)."""

from __future__ import annotations

from torch import nn

from tokenmill.kv.specs import CacheLayer, FullAttentionSpec, LatentAttentionSpec, PagedCacheSpec
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import SparseMoeBlock


def linear_flops_per_token(model: nn.Module) -> int:
    """2 FLOPs per weight of every linear layer a token goes through (not the output head, which
    runs for sampled rows only); routed experts at top_k of num_experts."""
    weights = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] != "lm_head":
            weights += module.in_features * module.out_features
        elif isinstance(module, SparseMoeBlock):
            experts = module.experts
            weights += 3 * experts.hidden_size * experts.intermediate_size * module.routing.top_k
    return 2 * weights


def attention_flops_per_key(model: nn.Module) -> int:
    """FLOPs one query token spends per key it attends to, over every full or latent attention layer
    (q·k and p·v: 2 FLOPs per head channel each)."""
    flops = 0
    for module in model.modules():
        spec_of = getattr(module, "cache_spec", None)
        spec = spec_of() if callable(spec_of) else None
        if isinstance(spec, FullAttentionSpec) and hasattr(module, "num_heads") and hasattr(module, "head_dim"):
            flops += 4 * module.num_heads * module.head_dim
        elif isinstance(spec, LatentAttentionSpec) and hasattr(module, "dims"):
            dims = module.dims
            flops += 2 * dims.num_heads * (dims.qk_head_dim + dims.v_head_dim)
    return flops


def prefill_attention_depth(model: nn.Module) -> int:
    """The depth at which a prefill token's attention costs as much as its linear layers (26.6k tokens
    for Llama-3.1-8B); 0 for a model without attention layers (its cost does not grow with depth)."""
    per_key = attention_flops_per_key(model)
    return linear_flops_per_token(model) // per_key if per_key else 0


def memory_grows_with_depth(model: nn.Module) -> bool:
    """Whether some paged cache layer's step allocates by the depth of its keys: any but full
    attention through a backend that streams the cache in place (the reference backend gathers a
    request's keys, MLA's prefill up-projects its whole latent context, QSA scores every pooled
    key). Recurrent-state layers keep a fixed size."""
    for module in model.modules():
        if not isinstance(module, CacheLayer) or not isinstance(spec := module.cache_spec(), PagedCacheSpec):
            continue
        in_place = getattr(getattr(module, "backend", None), "reads_cache_in_place", False)
        if not (isinstance(spec, FullAttentionSpec) and in_place):
            return True
    return False

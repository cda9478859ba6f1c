"""The routed experts of a MoE layer, stacked: w13 [E, 2I, H] (each expert's gate rows, then its
up rows) and w2 [E, H, I]; activation SiLU-and-mul.

    forward(x, topk_weights, topk_ids)[t] = sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])

On CUDA with `fused` the Triton kernels run (tokenmill/kernels/moe/experts.py: a few-row stream
over the selected experts for decode, grouped GEMMs over the expert-sorted tokens for prefill);
otherwise `fused_experts_ref`, which sorts the tokens by expert and multiplies per expert, in
the order and precision of transformers' own experts loop.

`weight_loader` copies one checkpoint tensor into the stacked parameters: a per-expert tensor
(the on-disk layout, `experts.{i}.gate_proj.weight` or Mixtral's `experts.{i}.w1.weight`) into
its expert's rows, or an already stacked one (transformers 5's in-memory `experts.gate_up_proj`
[E, 2I, H] and `experts.down_proj` [E, H, I]) whole. `checkpoint_target` maps the names.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError

Shard = Literal["gate", "up", "down"]

# checkpoint name after `experts.` -> (parameter, shard); per-expert names carry their expert index
_PER_EXPERT = re.compile(r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PROJ: dict[str, tuple[str, Shard]] = {
    "gate_proj": ("w13", "gate"), "w1": ("w13", "gate"),
    "up_proj": ("w13", "up"), "w3": ("w13", "up"),
    "down_proj": ("w2", "down"), "w2": ("w2", "down"),
}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fused: bool = False) -> None:
        """fused: run the Triton kernels (CUDA models)."""
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.fused = fused
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        addend: torch.Tensor | None = None,
        addend_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H], topk_weights float32 [T, k], topk_ids int32 [T, k] -> [T, H]; plus addend [T, H]
        (a shared expert's output), times sigmoid(addend_gate [T, 1]) if given."""
        if self.fused:
            from tokenmill.kernels.moe.experts import fused_experts

            return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, addend, addend_gate)
        return fused_experts_ref(x, self.w13, self.w2, topk_weights, topk_ids, addend, addend_gate)

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, int | None, Shard | None] | None:
        """(parameter, expert or None for a stacked tensor, shard) for a checkpoint name relative
        to the experts module (`3.up_proj.weight`, `3.w1.weight`, `gate_up_proj`); None if unknown."""
        match = _PER_EXPERT.fullmatch(name)
        if match:
            param, shard = _PROJ[match["proj"]]
            return param, int(match["expert"]), shard
        if name in _STACKED:
            return _STACKED[name], None, None
        return None

    @torch.no_grad()
    def weight_loader(self, param_name: str, tensor: torch.Tensor, expert_id: int | None = None,
                      shard: Shard | None = None) -> None:
        """Copy a checkpoint tensor into w13 or w2: expert_id None takes the whole stacked
        parameter; with an expert, shard "gate" / "up" takes that half of its w13 rows (None: both,
        a fused gate_up), "down" (or None) its w2."""
        if param_name not in ("w13", "w2"):
            raise ModelLoadError(f"FusedMoE has no parameter {param_name!r} (w13, w2)")
        param = getattr(self, param_name)
        if expert_id is None:
            dest = param
        elif not 0 <= expert_id < self.num_experts:
            raise ModelLoadError(f"expert {expert_id} is out of range: the layer has {self.num_experts} experts")
        else:
            dest = param[expert_id]
            shards = ("gate", "up") if param_name == "w13" else ("down",)
            if shard is not None and shard not in shards:
                raise ModelLoadError(f"{param_name} has no shard {shard!r} ({', '.join(shards)})")
            if shard in ("gate", "up"):
                inter = self.intermediate_size
                dest = dest[:inter] if shard == "gate" else dest[inter:]
        if dest.shape != tensor.shape:
            where = "" if expert_id is None else f"[{expert_id}]" + (f" {shard}" if shard else "")
            raise ModelLoadError(f"experts.{param_name}{where}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"layer shape {tuple(dest.shape)}")
        dest.copy_(tensor)


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    addend: torch.Tensor | None = None,
    addend_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: slots sorted by expert, one gate-up and one down matmul per expert that has
    any, each expert's weighted output added to its tokens in ascending expert order, in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = slice(start, start + count)
        start += count
        gate, up = F.linear(x[tokens[rows]], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens[rows], (y.float() * weights[rows, None]).to(x.dtype))
    if addend is not None:
        out = out + (addend if addend_gate is None else torch.sigmoid(addend_gate) * addend)
    return out

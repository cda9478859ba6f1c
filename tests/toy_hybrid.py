"""A toy hybrid architecture registered from outside tokenmill: attention layers over the paged KV
cache beside recurrent layers whose state lives in per-request slots (its own cache specs).

Each block is x += attention(x) or x += W_out tanh(s_t), with s_t = decay * s_{t-1} + W_in x_t per
request. `reference_logits` computes the same function over a whole sequence with plain torch
(no cache, no batching), the oracle the engine's chunked, batched, preempted runs must match.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kv.specs import FullAttentionSpec, RecurrentStateSpec, StateTensor
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM, ModelBuild
from tokenmill.models.weights import load_checkpoint

ARCHITECTURE = "ToyHybridForCausalLM"


class ToyAttention(nn.Module):
    def __init__(self, build: ModelBuild) -> None:
        super().__init__()
        c = build.hf_config
        self.heads, self.head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.out = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.backend = build.attention_backend
        self.spec = FullAttentionSpec(build.block_size, build.cache_dtype(), self.heads, self.head_dim)
        self.kv_cache = torch.empty(0)

    def cache_spec(self) -> FullAttentionSpec:
        return self.spec

    def bind_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.heads, self.head_dim).unbind(1)
        out = self.backend.forward(q, k, v, self.kv_cache, ctx.attention, self.head_dim**-0.5)
        return self.out(out.flatten(1))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.heads, self.head_dim).permute(1, 2, 0, 3).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(out.transpose(0, 1).flatten(1))


class DecayingSum(nn.Module):
    """The recurrent layer: one state vector per request, in a slot of the state pool."""

    def __init__(self, build: ModelBuild) -> None:
        super().__init__()
        size = build.hf_config.hidden_size
        self.w_in = nn.Linear(size, size, bias=False)
        self.w_out = nn.Linear(size, size, bias=False)
        self.decay = 0.9
        self.spec = RecurrentStateSpec((StateTensor("sum", (size,), torch.float32),))
        self.state = torch.empty(0)

    def cache_spec(self) -> RecurrentStateSpec:
        return self.spec

    def bind_cache(self, cache: dict[str, torch.Tensor]) -> None:
        self.state = cache["sum"]

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        assert ctx.state_slots is not None
        drive = self.w_in(x).float()
        out = torch.empty_like(drive)
        starts = ctx.attention.query_start_loc.tolist()
        for b, slot in enumerate(ctx.state_slots.tolist()):
            first, last = starts[b], starts[b + 1]
            # A request's first chunk starts from zeros (whatever its slot held before).
            s = self.state[slot] if int(ctx.positions[first]) > 0 else torch.zeros_like(self.state[slot])
            for t in range(first, last):
                s = self.decay * s + drive[t]
                out[t] = s
            self.state[slot] = s
        return self.w_out(torch.tanh(out).to(x.dtype))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        drive, s, out = self.w_in(x).float(), torch.zeros(x.shape[1]), []
        for t in range(x.shape[0]):
            s = self.decay * s + drive[t]
            out.append(s)
        return self.w_out(torch.tanh(torch.stack(out)).to(x.dtype))


class ToyHybridForCausalLM(CausalLM):
    def __init__(self, build: ModelBuild) -> None:
        super().__init__(build)
        c = build.hf_config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.blocks = nn.ModuleList(
            ToyAttention(build) if kind == "attention" else DecayingSum(build) for kind in c.toy_layer_types)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, packed={})

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        x = self.embed(torch.tensor(token_ids))
        for block in self.blocks:
            x = x + block.reference(x)
        return self.head(x)

"""DFlash2's additions to the DFlash block drafter (models/dflash.py): grouped dynamic causal
convolutions around every attention and MLP, and the candidate selector.

Layout followed: z-lab/dflash's `GroupedDynamicCausalConv`, `_grouped_dynamic_convolve` and
`CandidateSelector` (dflash/model.py), under the published tensor names:
- `{attention_conv, mlp_conv}.base_kernel` [2, taps, H] (side 0 before the sublayer, side 1
  after it) and `.kernel_projection.weight` [2 * taps * G, H] (G = H / conv_group_size). One
  projection of the sublayer's input gives both sides' dynamic coefficients
  ([..., side, tap, group]); row t of a side's output is
  sum_tap (base[side, tap] + dynamic[t, tap, group]) * x[t - tap], reading only rows of the same
  block (zeros before the block's first row: the convolution never crosses a block boundary).
- `candidate_selector.hidden_projection.weight` [rank, H], `predecessor_codebook` [V, rank],
  `successor_codebook` [V, rank]: the top_k candidates of each position's (scaled, softcapped)
  logits, scored given the token drawn at the position before (the anchor for the first) as
  unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[candidate]>.
  A walk from the anchor draws each position from its row (greedily: the best candidate).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.step_context import StepContext
from tokenmill.models.dflash_config import ConvShape, SelectorShape
from tokenmill.quantization.base import QuantizationConfig


def block_rows(ctx: StepContext) -> torch.Tensor:
    """[T] each row's index within its request's rows (its block), on the device."""
    metadata = ctx.attention
    rows = ctx.token_rows
    if rows is None:
        lengths = torch.tensor(metadata.query_lens_host, device=ctx.positions.device)
        rows = torch.repeat_interleave(torch.arange(len(metadata.query_lens_host), device=ctx.positions.device), lengths)
    return torch.arange(ctx.num_tokens, device=ctx.positions.device) - metadata.query_start_loc[rows].long()


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden_size: int, shape: ConvShape, quant: QuantizationConfig, prefix: str) -> None:
        super().__init__()
        self.taps, self.group = shape.taps, shape.group
        self.groups = hidden_size // shape.group
        kernel = torch.zeros(2, shape.taps, hidden_size)
        kernel[:, 0] = 1.0  # identity until loaded
        self.base_kernel = nn.Parameter(kernel, requires_grad=False)
        self.kernel_projection = Linear(hidden_size, 2 * shape.taps * self.groups, bias=False,
                                        method=quant.linear_method(f"{prefix}.kernel_projection"))

    def prepare(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input side's convolution of x, the output side's dynamic coefficients [T, taps, G])."""
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)
        return self._convolve(x, dynamic[:, 0], 0, rows), dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, 1, rows)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, side: int, rows: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        blocks = x.view(tokens, self.groups, self.group)
        out = torch.zeros_like(blocks)
        for tap in range(self.taps):
            if tap == 0:
                values = blocks
            else:  # row t reads row t - tap of its own block, zero before the block's first row
                shifted = torch.cat([blocks.new_zeros(tap, self.groups, self.group), blocks[:-tap]])
                values = torch.where((rows >= tap)[:, None, None], shifted, 0.0)
            kernel = self.base_kernel[side, tap].view(self.groups, self.group).to(x.dtype)
            out = out + kernel * values
            out = torch.addcmul(out, dynamic[:, tap, :, None].to(x.dtype), values)
        return out.view_as(x)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, shape: SelectorShape, quant: QuantizationConfig) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.vocab_size = vocab_size
        self.hidden_projection = Linear(hidden_size, shape.rank, bias=False,
                                        method=quant.linear_method("candidate_selector.hidden_projection"))
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, shape.rank), requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, shape.rank), requires_grad=False)

    def candidates(self, logits: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unary scores [N, k] float32, candidate ids [N, k], projected hidden [N, rank] float32) of
        N positions' logits and final hidden rows: everything a walk needs, computed once."""
        unary, ids = torch.topk(logits.float(), self.top_k, dim=-1)
        return unary, ids, self.hidden_projection(hidden).float()

    def scores(self, unary: torch.Tensor, ids: torch.Tensor, projected: torch.Tensor,
               previous: torch.Tensor) -> torch.Tensor:
        """[B, k]: the candidates' scores given the previous token of each row ([B] ids)."""
        context = self.predecessor_codebook[previous].float() * projected
        return unary + torch.einsum("br,bkr->bk", context, self.successor_codebook[ids].float())

    def greedy_walk(self, unary: torch.Tensor, ids: torch.Tensor, projected: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
        """[B, G] the walk from the anchors [B] taking each position's best candidate given the one
        taken before ([B, G, k] unary and ids, [B, G, rank] projected): upstream's select at
        temperature 0. The successor terms are formed once; each step gathers one codebook row."""
        terms = self.successor_codebook[ids].float() * projected[:, :, None, :]  # [B, G, k, rank]
        previous, path = anchors, []
        for step in range(ids.shape[1]):
            context = self.predecessor_codebook[previous].float()  # [B, rank]
            scores = unary[:, step] + torch.bmm(terms[:, step], context[:, :, None]).squeeze(-1)
            previous = ids[:, step].gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
            path.append(previous)
        return torch.stack(path, dim=1)

    def row(self, unary: torch.Tensor, ids: torch.Tensor, projected: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[B, V] the selector's row: the candidates' scores at their ids, -inf elsewhere."""
        full = torch.full((ids.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=ids.device)
        return full.scatter_(1, ids, self.scores(unary, ids, projected, previous))

"""The pre-norm decoder loop most families share: layers over a residual stream, recording the
stream entering layer i where the step asks for it (MTP taps, block drafters' hidden states)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.layers.step_context import StepContext


def run_decoder_layers(x: torch.Tensor, layers: Iterable[nn.Module], ctx: StepContext,
                       *layer_args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, residual) after `layers`, each called as layer(x, residual, ctx, *layer_args); the
    stream entering layer i (x + residual) is ctx.hidden[i] for each i in ctx.keep_hidden."""
    residual: torch.Tensor | None = None
    for i, layer in enumerate(layers):
        if i in ctx.keep_hidden:
            ctx.hidden[i] = x if residual is None else x + residual
        x, residual = layer(x, residual, ctx, *layer_args)
    return x, residual

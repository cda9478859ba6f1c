"""Calibration for `tokenmill quantize`: the model in float32, forwards over the shipped corpus,
and the largest |x| entering every linear layer and every routed expert (gate/up input, and the
SiLU-and-mul product entering its down projection), by the checkpoint's module names; for GPTQ
also Σ xᵀx of every linear layer's inputs.

The model runs through tokenmill's own layers and reference attention into scratch caches, a
sequence of at most SEQUENCE_TOKENS tokens per forward, so calibration sees what serving computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from tokenmill.kv.planner import allocate_caches
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe.fused_moe import FusedMoE
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM
from tokenmill.quantize.gptq import HessianSum
from tokenmill.runner.batch import Chunk, pack

SEQUENCE_TOKENS = 512
BLOCK_SIZE = 16


@dataclass
class ActivationAmax:
    """Largest |x| seen per model module (Linear: its input) and per routed expert."""

    linear: dict[str, float] = field(default_factory=dict)
    hessians: HessianSum | None = None  # also Σ xᵀx of every linear layer's inputs (for GPTQ) when given
    expert_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # [E] amax of the tokens routed to e
    expert_hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # [E] amax entering each down projection

    def note_linear(self, path: str, x: torch.Tensor) -> None:
        self.linear[path] = max(self.linear.get(path, 0.0), float(x.detach().abs().amax()) if x.numel() else 0.0)
        if self.hessians is not None:
            self.hessians.note(path, x)

    def note_experts(self, path: str, layer: FusedMoE, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        experts = layer.num_experts
        inputs = self.expert_inputs.setdefault(path, torch.zeros(experts))
        hidden = self.expert_hidden.setdefault(path, torch.zeros(experts))
        w13, _ = layer.dequantized_weights()
        for expert in topk_ids.unique().tolist():
            rows = x[(topk_ids == expert).any(dim=-1)].float()
            gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
            inputs[expert] = max(inputs[expert], rows.abs().amax())
            hidden[expert] = max(hidden[expert], (F.silu(gate) * up).abs().amax())


def record_activations(model: CausalLM, amax: ActivationAmax, only: Callable[[str], bool] = lambda path: True):
    """Hooks that record into `amax` (remove them with .remove() on each)."""
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, Linear) and only(path):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, p=path: amax.note_linear(p, args[0])))
        elif isinstance(module, FusedMoE) and only(path):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, p=path: amax.note_experts(p, m, args[0], args[2])))
    return handles


@torch.inference_mode()
def sequence_logits(model: CausalLM, token_ids: list[int], device: torch.device, last_only: bool = False) -> torch.Tensor:
    """Logits of one sequence of at most SEQUENCE_TOKENS tokens (every position, or the last), from
    fresh scratch caches."""
    if len(token_ids) > SEQUENCE_TOKENS:
        raise ValueError(f"a sequence of {len(token_ids)} tokens; at most {SEQUENCE_TOKENS}")
    allocate_caches(model.cache_layers(), -(-SEQUENCE_TOKENS // BLOCK_SIZE), 1, device)
    ids, positions, metadata = pack([Chunk(token_ids, 0, range(-(-len(token_ids) // BLOCK_SIZE)))], BLOCK_SIZE, device)
    hidden = model(ids, StepContext(positions, metadata))
    return model.compute_logits(hidden[-1:] if last_only else hidden)


class _Enough(Exception):
    """Raised by the hook on `stop_after`: the rest of the forward is not needed."""


def run_calibration(model: CausalLM, token_ids: list[int], device: torch.device, what: str,
                    progress: bool = True, head: bool = False, stop_after: nn.Module | None = None) -> None:
    """Forward every SEQUENCE_TOKENS-token slice of token_ids (each a sequence of its own); with
    `head`, the logits of every position (so a hook on the output head sees all its inputs); with
    `stop_after`, each forward ends once that module has run."""
    slices = [token_ids[i: i + SEQUENCE_TOKENS] for i in range(0, len(token_ids), SEQUENCE_TOKENS)]
    handle = None
    if stop_after is not None:
        def enough(module: nn.Module, args: object, output: object) -> None:
            raise _Enough
        handle = stop_after.register_forward_hook(enough)
    try:
        for chunk in tqdm(slices, desc=f"calibrating ({what})", unit="seq", disable=not progress):
            try:
                sequence_logits(model, chunk, device, last_only=not head)
            except _Enough:
                pass
    finally:
        if handle is not None:
            handle.remove()


def calibrate(model: CausalLM, token_ids: list[int], device: torch.device, what: str,
              only: Callable[[str], bool] = lambda path: True, progress: bool = True,
              hessians: HessianSum | None = None, stop_after: nn.Module | None = None) -> ActivationAmax:
    amax = ActivationAmax(hessians=hessians)
    handles = record_activations(model, amax, only)
    try:
        run_calibration(model, token_ids, device, what, progress, head=only("lm_head"), stop_after=stop_after)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def quantizable_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The model's Linear layers (not routers or one-row gates) and routed experts, by path."""
    from tokenmill.layers.moe.sparse_moe_block import RouterGate

    for path, module in model.named_modules():
        if isinstance(module, FusedMoE) or (isinstance(module, Linear) and not isinstance(module, RouterGate)
                                            and module.out_features > 1):
            yield path, module


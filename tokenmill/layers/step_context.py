"""What one forward sees besides its token ids: positions, the attention layout, state slots and
per-request inputs. The runner builds it per step; under CUDA graphs every tensor here is a
static buffer the graph was captured over, filled before each replay (runner/cuda_graphs.py),
so a new per-request input is one more entry in `request_inputs`, never a new graph code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.attention.backend import AttentionMetadata


@dataclass(frozen=True)
class RequestInputSpec:
    """A per-request input a model reads ([B, *shape] of dtype); padding rows of a CUDA graph hold `pad`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float = 0.0


@dataclass
class StepContext:
    positions: torch.Tensor  # [T] int64
    attention: AttentionMetadata  # shared by every paged cache layer (they share block ids)
    state_slots: torch.Tensor | None = None  # [B] int64: each request's recurrent-state slot
    # [T] int64: after this token also write the recurrent state into this slot (-1: none); set
    # when a step keeps states for draft rollback or prefix-cache snapshots.
    state_checkpoints: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None  # [T] int64: the request row of each token
    request_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B, ...]
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [T, ...] (an MTP head's hidden states)
    keep_hidden: tuple[int, ...] = ()  # layers whose input hidden states the forward records
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, H], filled by the forward
    # Per-token outputs the model declares (`CausalLM.token_outputs`), [T] each, filled by the forward.
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

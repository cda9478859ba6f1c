"""The scheduler -> runner contract: one step as plain ints, lists and device tensors.

The engine turns its scheduled requests into a StepInput; the runner reads nothing else of
them. Each request contributes `num_rows` consecutive rows: the ids it knows on the host, then
drafts known only on the device, then (under async scheduling) a placeholder for the token the
step still in flight samples. Its last `num_sampled_rows` rows are sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.sample.draft_verification import DraftsToVerify
from tokenmill.sample.sampler import SamplingRow


@dataclass
class RequestRows:
    token_ids: list[int]  # host-known ids of its first rows, from position `start`
    start: int
    num_rows: int
    block_ids: Sequence[int]  # its block table (every paged cache layer shares it)
    state_slot: int | None = None  # its recurrent-state slot (models with state only)
    device_drafts: torch.Tensor | None = None  # [n] int64 right after token_ids
    placeholder_row: int | None = None  # its last row's id is this row of the previous step's samples
    num_sampled_rows: int = 0  # 0, or 1 + drafts
    # Per row, a recurrent-state slot to write the state after it into (-1: none); None: no row has one.
    checkpoint_slots: Sequence[int] | None = None
    # Its values of the model's per-request inputs (CausalLM.request_inputs), e.g. steering strengths.
    inputs: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        drafts = 0 if self.device_drafts is None else self.device_drafts.numel()
        placeholder = self.placeholder_row is not None
        if len(self.token_ids) + drafts + placeholder != self.num_rows:
            raise ValueError(f"{len(self.token_ids)} host ids + {drafts} device drafts + {int(placeholder)} "
                             f"placeholder != {self.num_rows} rows")
        if self.checkpoint_slots is not None and len(self.checkpoint_slots) != self.num_rows:
            raise ValueError(f"{len(self.checkpoint_slots)} checkpoint slots for {self.num_rows} rows")


@dataclass
class StepInput:
    requests: list[RequestRows]
    sampling: list[SamplingRow] = field(default_factory=list)  # one per request with sampled rows, in order
    allowed_masks: list[torch.Tensor | None] = field(default_factory=list)  # [V] bool per sampling row (grammars)
    drafts: list[DraftsToVerify] | None = None  # with speculative decoding: per sampling request
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (from, to) state slots, before the forward

    @property
    def num_rows(self) -> int:
        return sum(r.num_rows for r in self.requests)

"""Drafts, and what a proposer reads and writes of a request (tokenmill.engine.request.Request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.kv.paged import CachedRequest
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True, eq=False)
class Drafts:
    """Tokens proposed after a request's last known one, verified by its next step.

    A draft model leaves its drafts on the device, so nothing waits for the host between
    drafting and verifying; n-gram lookup (and a draft model under penalties, which count each
    draft) knows them on the host. When count > 0 at least one of the two is set.
    """

    count: int = 0
    host_ids: list[int] | None = None
    device_ids: torch.Tensor | None = None  # [count] int64 on the model's device
    probs: torch.Tensor | None = None  # [count, V]: each draft's distribution as sampled; None = one-hot


NO_DRAFTS = Drafts()


class DraftingRequest(CachedRequest, Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    drafts: Drafts
    draft_num_computed: int  # positions of a draft model's cache that hold this request's tokens

    def banned_token_ids(self, extra_outputs: int = 0) -> list[int]: ...

"""Proposers: who writes the drafts the target verifies. One interface, chosen by config."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from tokenmill.config import BLOCK_DRAFTERS, EngineConfig, SpeculativeConfig
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.kv.specs import CacheLayer
from tokenmill.models.loader import CheckpointSource
from tokenmill.runner.model_runner import HeadBuilder, ModelRunner, StepOutput
from tokenmill.speculative.dflash import DFlashProposer
from tokenmill.speculative.dflash_draft import DFlashDraft
from tokenmill.speculative.draft_model import DraftModel, DraftModelProposer
from tokenmill.speculative.drafts import NO_DRAFTS, DraftingRequest, Drafts
from tokenmill.speculative.mtp import MTPDraft, MTPProposer
from tokenmill.speculative.ngram import NgramProposer

logger = logging.getLogger(__name__)

Drafter = DraftModel | MTPDraft | DFlashDraft
"""What a proposer needs built before the target's runner sizes its caches."""


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        """Set each request's drafts (at most its limit of them)."""

    def follow(self, scheduled: Sequence[tuple[DraftingRequest, int]], sampled: Sequence[DraftingRequest],
               step: StepOutput | None) -> None:
        """Work behind a launched step, before the host reads its result: a draft model computes
        the step's prompt chunks too (`scheduled`: each request with its tokens this step), and
        starts on the next proposal (`step`: what it samples, a row per request of `sampled`)."""

    def forget(self, request_id: str) -> None:
        """Drop any state kept for a request that finished or was aborted."""


class PromptLookupProposer:
    """n-gram prompt lookup: what followed the latest earlier occurrence of the context's suffix."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        for request, limit in zip(requests, limits):
            ids = list(self.ngram.propose_request(request.request_id, request.all_token_ids, limit))
            request.drafts = Drafts(len(ids), host_ids=ids) if ids else NO_DRAFTS

    def follow(self, scheduled: Sequence[tuple[DraftingRequest, int]], sampled: Sequence[DraftingRequest],
               step: StepOutput | None) -> None:
        pass  # lookups need the accepted tokens on the host

    def forget(self, request_id: str) -> None:
        self.ngram.remove_request(request_id)


def build_drafter(config: EngineConfig, source: CheckpointSource) -> Drafter | None:
    """The draft model (draft_model), or the builder of a head on the target (mtp; dflash and
    dflash2: a block drafter), before the target's runner."""
    method = config.speculative.method
    if method == "draft_model":
        return DraftModel(config)
    if method == "mtp":
        return MTPDraft(config, source)
    if method in BLOCK_DRAFTERS:
        return DFlashDraft(config)
    return None


def runner_companions(drafter: Drafter | None) -> tuple[dict[str, CacheLayer] | None, HeadBuilder | None]:
    """(a draft model's cache layers, the builder of a head on the target) for the target's ModelRunner."""
    if isinstance(drafter, DraftModel):
        return drafter.cache_layers(), None
    return None, drafter


def reads_target_hidden(config: EngineConfig) -> bool:
    """Whether the proposer drafts from the target's hidden states (so a prefix hit recomputes its last block)."""
    return config.speculative.method == "mtp"


def build_proposer(
    config: EngineConfig, target: ModelRunner, kv: KVCacheCoordinator, drafter: Drafter | None
) -> Proposer | None:
    method = config.speculative.method
    if method is None:
        return None
    if method == "ngram":
        return PromptLookupProposer(config.speculative)
    assert drafter is not None, "the engine builds the drafter before the target sizes its cache"
    if isinstance(drafter, MTPDraft):
        return MTPProposer(config, drafter, target, kv)
    if isinstance(drafter, DFlashDraft):
        return DFlashProposer(config, drafter, target, kv)
    return DraftModelProposer(config, drafter, target, kv)


class BatchSizeRule:
    """Speculation off in a step with more decoding requests than `limit` (SpeculativeConfig.
    disable_by_batch_size, or the batch the captured verify graphs hold); logged as it turns off
    and on again."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.off = False

    @classmethod
    def of(cls, config: EngineConfig, target: ModelRunner) -> BatchSizeRule:
        limit = config.speculative.disable_by_batch_size
        if limit is None and len(target.graphs) > 1:
            limit = target.graphs[-1].max_batch  # the verify graphs'
        return cls(limit)

    def allows(self, decoding: int) -> bool:
        off = self.limit is not None and decoding > self.limit
        if off != self.off:
            self.off = off
            if off:
                logger.info("speculation off: %d decoding requests are more than %d (disable_by_batch_size, or the batch "
                            "the verify graphs hold)", decoding, self.limit)
            else:
                logger.info("speculation on again: %d decoding requests", decoding)
        return not off

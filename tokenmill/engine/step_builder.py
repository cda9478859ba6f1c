"""Scheduled requests -> the runner's StepInput (runner/step_input.py): the one place the engine's
request state becomes plain rows, sampling rows and drafts to verify."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledBatch
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.layers.steering import strength_input
from tokenmill.runner.step_input import RequestRows, StepInput
from tokenmill.sample.draft_verification import DraftsToVerify
from tokenmill.sample.rejection import benchmark_accepted
from tokenmill.sample.sampler import SamplingRow


def build_step_input(
    batch: ScheduledBatch, sampling: Sequence[Request], kv: KVCacheCoordinator, previous: Sequence[Request],
    config: EngineConfig,
) -> StepInput:
    """`previous`: the sampled requests of the step still in flight, in its row order (their
    placeholders are read from its samples)."""
    previous_row = {id(r): i for i, r in enumerate(previous)}
    rows = [_request_rows(r, n, kv, previous_row) for r, n in zip(batch.requests, batch.num_new_tokens)]
    sampling_rows = [_sampling_row(r) for r in sampling]
    masks = [None if r.grammar is None else r.grammar.allowed_token_mask() for r in sampling]
    drafts = None
    if config.speculative.method is not None:
        length = config.benchmark_only.acceptance_length
        drafts = [_drafts_to_verify(r, length) for r in sampling]
    return StepInput(rows, sampling_rows, masks, drafts, state_copies=kv.take_state_copies())


def _request_rows(request: Request, n: int, kv: KVCacheCoordinator, previous_row: dict[int, int]) -> RequestRows:
    start = request.num_computed_tokens
    tokens = request.all_token_ids[start : start + n]
    drafts = request.drafts
    device_drafts = None
    if len(tokens) < n and drafts.count:
        offset = max(0, start - len(request.all_token_ids))
        wanted = min(drafts.count - offset, n - len(tokens))
        if drafts.host_ids is not None:
            tokens += drafts.host_ids[offset : offset + wanted]
        else:
            assert drafts.device_ids is not None
            device_drafts = drafts.device_ids[offset : offset + wanted]
    known = len(tokens) + (0 if device_drafts is None else device_drafts.numel())
    placeholder = None
    if known < n:  # the last token is a placeholder: read it on the device
        assert known == n - 1, "at most one token per request is in flight"
        placeholder = previous_row[id(request)]
    sampled = drafts.count + 1 if start + n == request.num_tokens_with_drafts else 0
    checkpoints = kv.state_checkpoints(request, len(request.prompt_token_ids), start, n, verifying=sampled > 1)
    inputs = {strength_input(name): value for name, value in request.steering.items()}
    return RequestRows(tokens, start, n, kv.block_tables[request.request_id], kv.state_slot(request.request_id),
                       device_drafts, placeholder, sampled, checkpoints, inputs)


def _sampling_row(request: Request) -> SamplingRow:
    return SamplingRow(
        params=request.params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        generator=request.generator,
        # A grammar decides when the answer may end; min_tokens must not forbid its stop.
        banned_token_ids=[] if request.grammar is not None else request.banned_token_ids(),
    )


def _drafts_to_verify(request: Request, benchmark_length: float | None) -> DraftsToVerify:
    """Position i of a request's drafts is processed as if the first i drafts had been sampled:
    penalties see them (which is why a proposer keeps drafts on the host under penalties),
    min_tokens counts them."""
    drafts = request.drafts
    rows = []
    for i in range(drafts.count + 1):
        outputs = request.output_token_ids
        if i and request.params.uses_penalties:
            assert drafts.host_ids is not None, "penalties need the drafts on the host"
            outputs = outputs + drafts.host_ids[:i]
        rows.append(SamplingRow(request.params, request.prompt_token_ids, outputs, None,
                                request.banned_token_ids(extra_outputs=i)))
    fixed = None
    if benchmark_length is not None:
        steps = request.spec_usage.num_drafts if request.spec_usage is not None else 0
        fixed = benchmark_accepted(benchmark_length, steps)
    return DraftsToVerify(rows, drafts.host_ids, drafts.device_ids if drafts.host_ids is None else None, drafts.probs,
                          request.params.greedy, request.generator, fixed)

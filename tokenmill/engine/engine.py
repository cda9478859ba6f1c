"""The synchronous engine: requests in, one scheduling step at a time, token deltas out."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledBatch, Scheduler
from tokenmill.engine.steering import check_strengths, record_projections
from tokenmill.engine.step_builder import build_step_input
from tokenmill.engine.structured_output import StructuredOutputManager, matcher_for
from tokenmill.errors import ConfigError, InvalidRequestError
from tokenmill.kv.coordinator import KVCacheCoordinator
from tokenmill.models.loader import load_hf_config, load_tokenizer, resolve_model
from tokenmill.models.steering_file import SteeringFile
from tokenmill.models.step_cost import prefill_attention_depth
from tokenmill.outputs import CompletionOutput, RequestOutput, SpecUsage, TokenLogprobs
from tokenmill.runner.model_runner import ModelRunner, StepOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.proposers import BatchSizeRule, build_drafter, build_proposer, reads_target_hidden, runner_companions
from tokenmill.speculative.stats import SpecStats

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20


@dataclass
class LaunchedStep:
    """A step in flight: its sampled requests, one per row of its output."""

    requests: list[Request]
    output: StepOutput


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found (and resumed: for hybrids, up to a state snapshot)
    prefix_cache_paged_hits: int  # tokens the paged KV alone matched (hybrids: a snapshot may be shallower)
    num_preemptions: int
    num_prompt_tokens: int  # tokens computed for prompts (cache hits excluded)
    num_generation_tokens: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_accepted_tokens_per_pos: list[int]
    state_snapshot_lookups: int = 0  # hybrid prefix caching: lookups with a paged hit
    state_snapshot_hits: int = 0  # of those, resumed from a recurrent-state snapshot
    state_snapshots_cached: int = 0
    state_snapshot_bytes_used: int = 0
    state_snapshot_bytes_total: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, steering: SteeringFile | None = None) -> None:
        """steering: a steering file to serve (else the one config.steering names, if any)."""
        config = config or EngineConfig()
        self.source = resolve_model(config.model.model, need_weights=config.model.load_format != "dummy")
        hf_config = load_hf_config(self.source)
        config = config.finalize(hf_config.max_position_embeddings)
        _check_sliding_window(hf_config, config.model.max_model_len)
        self.hf_config = hf_config
        self.tokenizer = load_tokenizer(self.source)
        self.model_name = config.model.model or self.source.name
        torch.manual_seed(config.model.seed)
        drafter = build_drafter(config, self.source)
        companion_cache_layers, head = runner_companions(drafter)
        self.runner = ModelRunner(config, hf_config, self.source, companion_cache_layers, head, steering)
        self.config = config.with_num_blocks(self.runner.num_blocks, prefill_attention_depth(self.runner.model))
        self.kv = KVCacheCoordinator(self.runner.cache_plan, config.cache.enable_prefix_caching,
                                     config.cache.mamba_state_interval, recompute_last_hit_block=reads_target_hidden(config))
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._computed_prompt_tokens = 0
        self._generated_tokens = 0
        self._structured_output: StructuredOutputManager | None = None
        self.async_scheduling = self.config.scheduler.async_scheduling
        self._in_flight: LaunchedStep | None = None
        self.spec_stats = SpecStats()
        self.proposer = build_proposer(self.config, self.runner, self.kv, drafter)
        self.spec_rule = BatchSizeRule.of(self.config, self.runner)

    @property
    def steering(self) -> SteeringFile | None:
        """The steering file served (requests may set its directions' strengths), or None."""
        return self.runner.steering

    def install_steering(self, file: SteeringFile) -> None:
        """Serve `file` from now on (an eager engine with no request in flight; `tokenmill steer build`)."""
        if self.has_unfinished_requests():
            raise ConfigError("steering can only be installed on an idle engine")
        if self.config.speculative.method is not None:
            raise ConfigError("--steering cannot be combined with speculative decoding yet; drop one")
        self.runner.install_steering(file)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        steering: Mapping[str, float] | None = None,
    ) -> None:
        """steering: a strength per direction of the served steering file (0 = unsteered)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise InvalidRequestError("the engine runs one sequence per request: fan out with params.for_child(i)")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs may be at most {MAX_LOGPROBS}, got {params.logprobs}")
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.model.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but the context is {max_len} tokens "
                "(max_model_len), which must leave room for at least one generated token"
            )
        room = max_len - len(token_ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds the "
                f"context of {max_len} tokens; ask for at most {room}"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=params.max_tokens or room,
            prompt=text,
            priority=priority,
            cache_salt=cache_salt,
            steering=check_strengths(self.steering, self.config.steering.steering_max_strength, steering),
            arrival_index=next(self._arrivals),
        )
        if params.seed is not None:
            request.generator = self.runner.make_generator(params.seed)
        spec = params.structured_output
        if spec is not None:
            request.grammar = (self._grammars().new_matcher(spec) if spec.compiled is None
                               else matcher_for(spec.compiled, self.hf_config.vocab_size))
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass the prompt as token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                raise InvalidRequestError(f"the prompt is not valid Unicode: a lone surrogate at character {error.start}"
                                          ) from None
            return prompt, list(self.tokenizer(prompt).input_ids)
        token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, token_ids

    def _grammars(self) -> StructuredOutputManager:
        if self._structured_output is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a model with a tokenizer")
            self._structured_output = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size)
        return self._structured_output

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort(request)
            self._forget(request_id)

    def abort_failed_step(self) -> list[str]:
        """After step() raised: aborts the requests the failed step held (the running batch and
        the step in flight, whose scheduler, KV and device state it may have left half-done) or,
        when it held none, the request it was admitting. Returns their ids; the engine can step
        again with the requests still waiting."""
        held = [r.request_id for r in self.scheduler.running]
        if self._in_flight is not None:
            held += [r.request_id for r in self._in_flight.requests]
        if not held and len(self.scheduler.waiting):
            held = [self.scheduler.waiting.peek().request_id]
        self._in_flight = None
        ids = [rid for rid in dict.fromkeys(held) if rid in self.requests]
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue: not scheduled yet, or preempted."""
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then resolve the step launched before it.

        With async scheduling the host prepares step N+1 while the device still runs step N:
        a request sampled in step N enters step N+1 with a placeholder whose id is read on the
        device. Requests whose sampling needs the previous token on the host (penalties,
        grammars) make the engine resolve first, so outputs equal synchronous mode's.
        """
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and (not self.async_scheduling or self._needs_host_tokens()):
            outputs += self._resolve(self._in_flight)
            self._in_flight = None
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.requests else None
        if self._in_flight is not None:
            outputs += self._resolve(self._in_flight)
        self._in_flight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._resolve(launched)
            self._in_flight = None
        return outputs

    def _propose(self) -> None:
        """Drafts for every decoding request, capped by what max_tokens and the context allow."""
        gamma = self.config.speculative.num_speculative_tokens
        max_len = self.config.model.max_model_len
        decoding, limits = [], []
        for request in self.scheduler.running:
            limit = min(gamma, request.max_tokens - request.num_output_tokens - 1, max_len - request.num_tokens)
            if request.num_computed_tokens == request.num_tokens - 1 and request.grammar is None and limit > 0:
                decoding.append(request)
                limits.append(limit)
        if decoding and self.spec_rule.allows(len(decoding)):
            self.proposer.propose(decoding, limits)

    def _needs_host_tokens(self) -> bool:
        return any(r.params.uses_penalties or r.grammar is not None for r in self.scheduler.running)

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep | None:
        sampling = batch.sampling_requests()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            start = request.num_computed_tokens
            self._computed_prompt_tokens += max(0, min(start + n, len(request.prompt_token_ids)) - start)
        previous = self._in_flight
        step = build_step_input(batch, sampling, self.kv, previous.requests if previous else (), self.config)
        output = self.runner.execute(step, previous.output if previous else None)
        launched = None if output is None else LaunchedStep(sampling, output)
        if self.proposer is not None:  # before finish_step: it reads each chunk's start
            self.proposer.follow(list(zip(batch.requests, batch.num_new_tokens)), sampling, output)
        self.scheduler.finish_step(batch)
        return launched

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        step.output.wait()
        outputs = []
        for row, (request, tokens, logprobs) in enumerate(zip(step.requests, step.output.token_lists(), _logprob_rows(step))):
            request.num_placeholders -= 1
            rejected = request.drafts.count - (len(tokens) - 1)
            if rejected:
                self.kv.rollback(request, request.num_computed_tokens - rejected)
            request.draft_num_computed = min(request.draft_num_computed, request.num_computed_tokens)
            self._record_spec(request, request.drafts.count, len(tokens) - 1)
            request.drop_drafts()
            if request.is_finished:  # aborted, or ended while this step was in flight
                continue
            if self.steering is not None:
                record_projections(request, self.steering, step.output.host_outputs, row)
            outputs.append(self._append_tokens(request, tokens, logprobs))
        return outputs

    def _record_spec(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if self.proposer is None:
            return
        self.spec_stats.record(num_drafts, num_accepted)
        usage = request.spec_usage = request.spec_usage or SpecUsage()
        if num_drafts:
            usage.num_drafts += 1
            usage.num_draft_tokens += num_drafts
            usage.num_accepted_tokens += num_accepted

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """Append a step's tokens (one, or accepted drafts plus one) until the request stops."""
        text_pieces: list[str] = []
        appended: list[int] = []
        detokenizer = self.detokenizers.get(request.request_id)
        for token_id in tokens:
            request.append_output(token_id)
            appended.append(token_id)
            self._generated_tokens += 1
            request.check_stop_token()
            if request.grammar is not None:
                request.grammar.accept_token(token_id)
                if request.grammar.is_terminated() and not request.is_finished:
                    request.finish("stop")
            if detokenizer is not None:
                # A stop token (EOS or stop_token_ids) ends the answer without entering its text.
                if request.finish_reason != "stop":
                    text_pieces.append(detokenizer.append([token_id]))
                if detokenizer.stop_reason is not None and not request.is_finished:
                    request.finish("stop", detokenizer.stop_reason)
                elif request.is_finished:
                    text_pieces.append(detokenizer.finish())
            if request.is_finished:
                break
        kept_logprobs = None if logprobs is None else logprobs[: len(appended)]
        if kept_logprobs:
            request.output_logprobs.extend(kept_logprobs)
        output = self._delta(request, appended, "".join(text_pieces), kept_logprobs)
        if request.is_finished:
            self.scheduler.release(request)
            del self.requests[request.request_id]
            self._forget(request.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def _delta(self, request: Request, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
            spec=None if request.spec_usage is None else replace(request.spec_usage),
            direction_projections=({k: list(v) for k, v in request.direction_projections.items()}
                                   if request.is_finished and self.steering is not None else None),
        )

    def stats(self) -> EngineStats:
        counters = self.kv.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.pool.num_used,
            kv_blocks_total=self.kv.num_blocks,
            prefix_cache_queries=counters.queried_tokens,
            prefix_cache_hits=counters.hit_tokens,
            prefix_cache_paged_hits=counters.paged_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._computed_prompt_tokens,
            num_generation_tokens=self._generated_tokens,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_position),
            **self.kv.snapshot_stats(),
        )



def _logprob_rows(step: LaunchedStep) -> list[list[TokenLogprobs] | None]:
    """Per request, one entry per emitted token: that token's logprob first, then the top-k."""
    output = step.output
    if output.host_logprobs is None:
        return [None] * len(step.requests)
    ids, values = output.host_logprob_ids.tolist(), output.host_logprobs.tolist()
    if output.host_num_accepted is None:  # one token per request: [B, 1 + k] -> [B, 1, 1 + k]
        ids, values = [[row] for row in ids], [[row] for row in values]
    rows: list[list[TokenLogprobs] | None] = []
    for request, request_ids, request_values in zip(step.requests, ids, values):
        k = request.params.logprobs
        if k is None:
            rows.append(None)
            continue
        entries = []
        for row_ids, row_values in zip(request_ids, request_values):
            entry: TokenLogprobs = {row_ids[0]: row_values[0]}  # a dict keeps the first occurrence's place
            for token, value in zip(row_ids[1 : 1 + k], row_values[1 : 1 + k]):
                entry.setdefault(token, value)
            entries.append(entry)
        rows.append(entries)
    return rows


def _eos_token_ids(hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, Iterable):
            ids.update(int(t) for t in source)
    return frozenset(ids)


def _check_sliding_window(hf_config, max_model_len: int) -> None:
    window = getattr(hf_config, "sliding_window", None)
    enabled = getattr(hf_config, "use_sliding_window", True)
    if window and enabled and max_model_len > window:
        raise ConfigError(
            f"this model uses sliding-window attention ({window} tokens), which tokenmill does not "
            f"implement; run it with --max-model-len {window} or less"
        )

"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    SteeringConfig,
)
from tokenmill.engine.engine import LLMEngine
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate for a list of prompts in one continuous batch.

    Keyword arguments name fields of the config tree (e.g. `max_model_len=4096`,
    `kv_cache_bytes=2**28`, `max_num_batched_tokens=16`, `device="cpu"`).
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = _apply_overrides(config or EngineConfig(model=ModelConfig(model=model)), overrides)
        self.engine = LLMEngine(config)
        self._ids = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        steering: Mapping[str, float] | Sequence[Mapping[str, float] | None] | None = None,
    ) -> list[RequestOutput]:
        """steering: strengths per direction of the served steering file (`LLM(steering=DIR)`), for
        every prompt or one mapping (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        strengths = list(steering) if isinstance(steering, Sequence) else [steering] * len(prompts)
        if len(strengths) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(strengths)} steering mappings")

        results: dict[str, RequestOutput] = {}
        unfinished: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
                parent = str(self._ids)
                self._ids += 1
                unfinished[parent] = p.n
                for child in range(p.n):
                    added.append(f"{parent}/{child}")
                    self.engine.add_request(
                        added[-1],
                        prompt,
                        p.for_child(child),
                        priority=priority[i] if priority else 0,
                        cache_salt=cache_salt,
                        steering=strengths[i],
                    )
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        order = list(unfinished)
        with tqdm(total=len(order), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    parent, child = delta.request_id.rsplit("/", 1)
                    _merge(results, parent, int(child), delta)
                    if delta.finished:
                        unfinished[parent] -= 1
                        bar.update(unfinished[parent] == 0)
        for rid in order:
            results[rid].finished = True
            results[rid].outputs.sort(key=lambda o: o.index)
        return [results[rid] for rid in order]


def _merge(results: dict[str, RequestOutput], parent: str, child: int, delta: RequestOutput) -> None:
    out = results.setdefault(
        parent,
        RequestOutput(request_id=parent, prompt=delta.prompt, prompt_token_ids=delta.prompt_token_ids,
                      num_cached_tokens=delta.num_cached_tokens),
    )
    completion = next((o for o in out.outputs if o.index == child), None)
    if completion is None:
        completion = CompletionOutput(index=child, text="", token_ids=[], logprobs=None)
        out.outputs.append(completion)
    new = delta.outputs[0]
    completion.text += new.text
    completion.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + new.logprobs
    completion.finish_reason = new.finish_reason
    completion.stop_reason = new.stop_reason
    if delta.spec is not None and len(out.outputs) == 1:
        out.spec = delta.spec
    if delta.direction_projections is not None and len(out.outputs) == 1:
        out.direction_projections = delta.direction_projections


def _apply_overrides(config: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                "steering": SteeringConfig}
    for key, value in overrides.items():
        if key in ("enforce_eager", "cuda_graph_capture", "benchmark_only"):
            config = replace(config, **{key: value})
            continue
        if key == "speculative_config":  # None: no speculation, as in vLLM
            spec = value if isinstance(value, SpeculativeConfig) else SpeculativeConfig(**(value or {}))
            config = replace(config, speculative=spec)
            continue
        for section, kind in sections.items():
            if key in kind.__dataclass_fields__:
                config = replace(config, **{section: replace(getattr(config, section), **{key: value})})
                break
        else:
            raise TypeError(f"unknown engine option {key!r}")
    return config

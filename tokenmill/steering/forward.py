"""What `tokenmill steer build` runs on an engine: plain forwards that record the residual stream
(scratch blocks borrowed from the engine's pool) and greedy generation, both at a steering strength."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.steering import strength_input
from tokenmill.layers.step_context import StepContext
from tokenmill.runner.batch import Chunk, pack
from tokenmill.sampling_params import SamplingParams

MAX_BATCH_TOKENS = 4096


@dataclass
class Forward:
    """Per sequence: the residual stream entering each kept layer at its last `tail` positions
    ({layer: [n, tail, H]} float64, in sequence order), the log-probabilities at its last position
    ([n, V]), and with `targets`, the summed log-probability of each sequence's last len(target)
    tokens given what precedes them ([n])."""

    hidden: dict[int, torch.Tensor]
    last_logprobs: torch.Tensor
    target_logprobs: torch.Tensor | None = None
    tail_logprobs: torch.Tensor | None = None  # with `tails`: each sequence's last n rows of log-probabilities, stacked


def _batches(sequences: Sequence[list[int]], limit: int) -> list[list[int]]:
    batches: list[list[int]] = [[]]
    tokens = 0
    for i, seq in enumerate(sequences):
        if batches[-1] and tokens + len(seq) > limit:
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += len(seq)
    return batches


@torch.inference_mode()
def forward(engine: LLMEngine, sequences: Sequence[list[int]], *, layers: Sequence[int] = (), tail: int = 1,
            strength: float = 0.0, targets: Sequence[int] | None = None, tails: Sequence[int] | None = None) -> Forward:
    """One prefill of every sequence (in batches of at most MAX_BATCH_TOKENS tokens), steered at
    `strength` when the engine serves a direction. targets: per sequence, how many of its last
    tokens to score; tails: per sequence, how many of its last rows' distributions to keep."""
    runner = engine.runner
    model, block_size, device = runner.model, runner.block_size, runner.device
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    logprobs: list[torch.Tensor] = []
    scored: list[float] = []
    kept: list[torch.Tensor] = []
    for batch in _batches(sequences, MAX_BATCH_TOKENS):
        seqs = [sequences[i] for i in batch]
        needed = [-(-len(s) // block_size) for s in seqs]
        blocks = engine.kv.pool.allocate(sum(needed))
        try:
            starts = [sum(needed[:i]) for i in range(len(seqs))]
            chunks = [Chunk(s, 0, blocks[b : b + n]) for s, b, n in zip(seqs, starts, needed)]
            ids, positions, metadata = pack(chunks, block_size, device)
            ctx = StepContext(positions, metadata, keep_hidden=tuple(layers))
            if engine.steering is not None:
                for name in engine.steering.directions:
                    ctx.request_inputs[strength_input(name)] = torch.full((len(seqs),), strength, device=device)
            out = model(ids, ctx)
            ends = torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()
            last = torch.tensor([e - 1 for e in ends], device=device)
            logprobs.append(torch.log_softmax(model.compute_logits(out[last]).float(), -1).cpu())
            if targets is not None:
                for i, end in zip(batch, ends):
                    n = targets[i]
                    rows = torch.arange(end - n - 1, end - 1, device=device)
                    step = torch.log_softmax(model.compute_logits(out[rows]).float(), -1)
                    scored.append(float(step.gather(1, ids[rows + 1].unsqueeze(1)).sum()))
            if tails is not None:
                rows = torch.tensor([end - tails[i] + k for i, end in zip(batch, ends) for k in range(tails[i])],
                                    device=device)
                kept.append(torch.log_softmax(model.compute_logits(out[rows]).float(), -1).cpu())
            rows = torch.tensor([e - tail + k for e in ends for k in range(tail)], device=device)
            for layer in layers:
                hidden[layer].append(ctx.hidden[layer][rows].double().cpu().view(len(seqs), tail, -1))
        finally:
            engine.kv.pool.free(blocks)
    return Forward({layer: torch.cat(parts) for layer, parts in hidden.items()}, torch.cat(logprobs),
                   None if targets is None else torch.tensor(scored, dtype=torch.float64),
                   None if tails is None else torch.cat(kept))


@dataclass
class Generated:
    text: str
    token_ids: list[int]
    projections: list[float]  # at the served direction's layer, the rows that sampled the first outputs


def generate(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, strength: float = 0.0) -> list[Generated]:
    """Greedy answers of `max_tokens` tokens (or to EOS), all at `strength`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    steering = {name: strength for name in engine.steering.directions} if engine.steering is not None else None
    ids = [f"steer-build-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params, steering=steering if strength else None)
    texts = {request_id: "" for request_id in ids}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    projections: dict[str, list[float]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].text
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished and out.direction_projections:
                projections[out.request_id] = next(iter(out.direction_projections.values()))
    return [Generated(texts[i], tokens[i], projections.get(i, [])) for i in ids]

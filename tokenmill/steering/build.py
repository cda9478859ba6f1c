"""`tokenmill steer build`: a refusal direction from the model's own activations (Arditi et al. 2024).

1. Both prompt sets go through the chat template; each is split (seeded) into train and validation.
2. Baseline: greedy answers of `score_tokens` tokens to every prompt, judged by the phrase
   detector. With `filter`, the train directions use only refuse prompts the model refused and
   comply prompts it answered.
3. The residual stream entering every layer, at each of the template's post-instruction positions
   (the tokens after the user's message, e.g. `<|im_end|> \\n <|im_start|> assistant \\n`), averaged
   over each train set in float64; a candidate per (layer, position) and per layer over the positions'
   mean: the difference of the means, normalised to unit length.
4. Candidates: per candidate layer (default 1 .. 80% of depth) its two positions that best separate
   the validation sets (Cohen's d of the projections).
5. Held-out scores, each candidate ablated at strength 1 from every residual write: the mean KL
   divergence (unsteered -> steered) of the next-token distributions over the first KL_TOKENS
   positions of the validation comply answers (teacher-forced), which must be <= max_comply_kl,
   and the drop in log-probability of the validation refusals' own openings (their first tokens,
   teacher-forced). The `shortlist` candidates with
   the largest drop are scored by what matters: the refusal rate on the validation refuse set
   (answers of `score_tokens` tokens, the detector). The pick: the lowest rate (then the lowest
   mean detector score, then KL).
6. Detector calibration: the chosen direction's projection at its layer over the rows that sample
   the first `detector_tokens` outputs, on the validation answers at strength 0, split by the
   baseline verdicts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import tokenmill
from tokenmill.config import EngineConfig, ModelConfig, ParallelConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.errors import ConfigError
from tokenmill.models.steering_file import (
    DetectorCalibration,
    SteeringDirection,
    SteeringFile,
    model_identity,
    save_steering_file,
)
from tokenmill.steering.detector import RefusalDetector
from tokenmill.steering.forward import Forward, Generated, forward, generate
from tokenmill.steering.prompts import ChatPrompts, read_prompts, split

MEAN = -1  # the position index of "the mean over the post-instruction positions"
POSITIONS_PER_LAYER = 2  # a layer's best-separating positions get the ablation proxies
PREFIX_TOKENS = 4  # tokens of each baseline refusal's opening the bypass proxy scores
KL_TOKENS = 8  # positions of each baseline comply answer (from its first) the KL averages over


@dataclass(frozen=True)
class BuildOptions:
    out: Path
    model: str | None = None
    refuse: Path | None = None
    comply: Path | None = None
    name: str = "refusal"
    device: str = "auto"
    dtype: str = "auto"
    val_fraction: float = 0.25
    seed: int = 0
    score_tokens: int = 16
    detector_tokens: int = 4
    layers: tuple[int, ...] | None = None
    shortlist: int = 6
    max_comply_kl: float = 0.1
    filter: bool = True


@dataclass
class Candidate:
    layer: int
    position: int  # MEAN, or an index into the post-instruction positions
    separation: float  # Cohen's d on the validation sets
    comply_kl: float | None = None  # validation comply answers, strength 1: mean next-token KL per position
    bypass: float | None = None  # drop in log P of the validation refusals' openings at strength 1
    refusal_rate: float | None = None  # validation refuse set, strength 1
    refusal_score: float | None = None  # the detector's mean score there (breaks ties of the rate)

    def describe(self, tokens: tuple[str, ...]) -> str:
        return "mean" if self.position == MEAN else f"{self.position} ({tokens[self.position]!r})"


@dataclass
class BuildReport:
    file: SteeringFile
    baseline: dict[str, float]
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None
    seconds: float = 0.0


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def _projections(forward_out: Forward, directions: dict[int, torch.Tensor], layer: int, position: int) -> torch.Tensor:
    h = forward_out.hidden[layer]  # [n, P, H]
    r = directions[layer][position]
    return (h @ r).mean(-1) if position == MEAN else h[:, position] @ r


def _cohens_d(a: torch.Tensor, b: torch.Tensor) -> float:
    pooled = math.sqrt((float(a.var(unbiased=True)) + float(b.var(unbiased=True))) / 2) if len(a) > 1 and len(b) > 1 else 0.0
    return (float(a.mean()) - float(b.mean())) / pooled if pooled > 0 else 0.0


def _kl(base: torch.Tensor, steered: torch.Tensor) -> float:
    """Mean KL(base || steered) of log-probability rows."""
    return float((base.exp() * (base - steered)).sum(-1).mean())


def build(options: BuildOptions, say: Callable[[str], None] = print) -> BuildReport:
    started = time.monotonic()
    config = EngineConfig(model=ModelConfig(model=options.model, dtype=options.dtype),
                          parallel=ParallelConfig(device=options.device), enforce_eager=True)
    engine = LLMEngine(config)
    chat = ChatPrompts.of(engine.tokenizer)
    num_layers = engine.hf_config.num_hidden_layers
    candidate_layers = options.layers or tuple(range(1, max(2, int(0.8 * num_layers))))
    if not all(0 <= layer < num_layers for layer in candidate_layers):
        raise ConfigError(f"--layers must be within 0..{num_layers - 1}")
    say(f"model {engine.model_name}: {num_layers} layers; post-instruction positions {list(chat.post_instruction_tokens)}")

    sets = {}
    for kind, path in (("refuse", options.refuse), ("comply", options.comply)):
        train, val = split(read_prompts(path, kind), options.val_fraction, options.seed)
        if len(train) < 4 or len(val) < 2:
            raise ConfigError(f"the {kind} set is too small ({len(train)} train, {len(val)} validation prompts)")
        sets[kind] = {"train": [chat.encode(p) for p in train], "val": [chat.encode(p) for p in val]}

    detector = RefusalDetector()
    say(f"baseline: answering {sum(len(v) for s in sets.values() for v in s.values())} prompts "
        f"({options.score_tokens} tokens each)")
    verdicts: dict[str, dict[str, list[bool]]] = {}
    answers_of: dict[str, dict[str, list[Generated]]] = {}
    for kind, parts in sets.items():
        answers = generate(engine, parts["train"] + parts["val"], options.score_tokens)
        flags = [detector.judge(a.text).refused for a in answers]
        split_at = len(parts["train"])
        verdicts[kind] = {"train": flags[:split_at], "val": flags[split_at:]}
        answers_of[kind] = {"train": answers[:split_at], "val": answers[split_at:]}
    baseline = {f"{kind}_{part}_refusal_rate": sum(v) / len(v) for kind, parts in verdicts.items() for part, v in parts.items()}
    say("baseline refusal rates: " + ", ".join(f"{k.removesuffix('_refusal_rate')} {v:.0%}" for k, v in baseline.items()))

    def kept(kind: str, part: str, refused: bool) -> list[list[int]]:
        prompts = sets[kind][part]
        if not options.filter:
            return prompts
        return [p for p, flag in zip(prompts, verdicts[kind][part]) if flag == refused]

    refuse_train, comply_train = kept("refuse", "train", True), kept("comply", "train", False)
    if len(refuse_train) < 4 or len(comply_train) < 4:
        raise ConfigError(f"the model refused {len(refuse_train)} of {len(sets['refuse']['train'])} train refuse prompts "
                          f"and answered {len(comply_train)} of {len(sets['comply']['train'])} comply prompts: too few to "
                          "take a difference of means; use prompt sets it does refuse (or --no-filter)")
    layers = tuple(range(num_layers))
    tail = chat.post_instruction
    say(f"residual stream at {num_layers} layers x {tail} positions: {len(refuse_train)} refused, "
        f"{len(comply_train)} answered train prompts")
    fr, fc = (forward(engine, ps, layers=layers, tail=tail) for ps in (refuse_train, comply_train))
    directions = {}
    for layer in layers:
        diff = fr.hidden[layer].mean(0) - fc.hidden[layer].mean(0)  # [P, H] float64
        directions[layer] = torch.cat([_unit(diff), _unit(diff.mean(0, keepdim=True))])  # index MEAN = -1: the mean

    refuse_val, comply_val = kept("refuse", "val", True), kept("comply", "val", False)
    if len(refuse_val) < 2 or len(comply_val) < 2:
        raise ConfigError("too few validation prompts the model refused or answered to score directions; "
                          "use larger prompt sets")
    vr, vc = forward(engine, refuse_val, layers=layers, tail=tail), forward(engine, comply_val, layers=layers, tail=tail)
    # The comply answers' own first tokens, teacher-forced: the KL over all of their positions.
    answered, kl_rows = [], []
    for prompt, answer, flag in zip(sets["comply"]["val"], answers_of["comply"]["val"], verdicts["comply"]["val"]):
        if not flag:
            answered.append(prompt + answer.token_ids[: KL_TOKENS - 1])
            kl_rows.append(len(answered[-1]) - len(prompt) + 1)
    base_comply = forward(engine, answered, tails=kl_rows).tail_logprobs
    # The refusals' own openings, teacher-forced: how much less likely ablation makes them.
    openings = [prompt + answer.token_ids[:PREFIX_TOKENS]
                for prompt, answer, flag in zip(sets["refuse"]["val"], answers_of["refuse"]["val"], verdicts["refuse"]["val"])
                if flag and answer.token_ids]
    opening_tokens = [min(PREFIX_TOKENS, len(seq) - 1) for seq in openings]
    base_openings = forward(engine, openings, targets=opening_tokens).target_logprobs
    candidates = []
    for layer in candidate_layers:
        ranked = sorted((Candidate(layer, pos, _cohens_d(_projections(vr, directions, layer, pos),
                                                         _projections(vc, directions, layer, pos)))
                         for pos in [*range(tail), MEAN]), key=lambda c: -c.separation)
        candidates += ranked[:POSITIONS_PER_LAYER]

    first = candidates[0]
    identity = model_identity(engine.runner.model, engine.hf_config, engine.model_name)
    placeholder = SteeringDirection(options.name, first.layer, directions[first.layer][first.position])
    engine.install_steering(SteeringFile(identity, {options.name: placeholder}))
    steering = engine.runner.model.residual_steering
    assert steering is not None and base_openings is not None and base_comply is not None
    say(f"ablation proxies of {len(candidates)} candidates (comply KL, drop in log P of the refusals' openings)")
    for c in candidates:
        steering.set_direction(directions[c.layer][c.position].float(), c.layer)
        steered_comply = forward(engine, answered, tails=kl_rows, strength=1.0).tail_logprobs
        assert steered_comply is not None
        c.comply_kl = _kl(base_comply, steered_comply)
        steered = forward(engine, openings, targets=opening_tokens, strength=1.0).target_logprobs
        assert steered is not None
        c.bypass = float((base_openings - steered).mean())
    eligible = [c for c in candidates if c.comply_kl is not None and c.comply_kl <= options.max_comply_kl]
    if not eligible:
        best_kl = min(c.comply_kl or math.inf for c in candidates)
        raise ConfigError(f"no candidate direction keeps the comply set's KL within {options.max_comply_kl} (the "
                          f"lowest is {best_kl:.4f}); raise --max-comply-kl or widen --layers")
    shortlist = sorted(eligible, key=lambda c: -(c.bypass or 0.0))[: options.shortlist]
    say(f"held-out refusal rate at strength 1 of the {len(shortlist)} best of {len(eligible)} within the KL bound:")
    for c in shortlist:
        steering.set_direction(directions[c.layer][c.position].float(), c.layer)
        answers = generate(engine, sets["refuse"]["val"], options.score_tokens, strength=1.0)
        verdicts_1 = [detector.judge(a.text) for a in answers]
        c.refusal_rate = sum(v.refused for v in verdicts_1) / len(answers)
        c.refusal_score = sum(v.score for v in verdicts_1) / len(answers)
        say(f"  layer {c.layer:>3} position {c.describe(chat.post_instruction_tokens):<18} d {c.separation:5.2f}  "
            f"opening drop {c.bypass:6.2f}  comply KL {c.comply_kl:.4f}  refusals {c.refusal_rate:4.0%} "
            f"(score {c.refusal_score:.3f})")
    chosen = min(shortlist, key=lambda c: (c.refusal_rate, c.refusal_score, c.comply_kl))
    vector = directions[chosen.layer][chosen.position]
    steering.set_direction(vector.float(), chosen.layer)
    calibration = _calibrate(engine, sets, verdicts, options.detector_tokens)
    info = {
        "positions": {"kind": "post-instruction", "tokens": list(chat.post_instruction_tokens),
                      "chosen": "mean" if chosen.position == MEAN else chosen.position},
        "normalization": "difference of means (float64) over unit L2 norm",
        "ablation": "w - s (w.r) r on every write into the residual stream (embedding, attention and MLP outputs)",
        "scores": {"validation_refusal_rate_strength_0": baseline["refuse_val_refusal_rate"],
                   "validation_refusal_rate_strength_1": chosen.refusal_rate, "comply_kl_strength_1": chosen.comply_kl,
                   "separation_d": chosen.separation,
                   "shortlist": [asdict(c) for c in shortlist],
                   "candidates": [asdict(c) for c in candidates]},
    }
    file = SteeringFile(identity, {options.name: SteeringDirection(options.name, chosen.layer, vector, calibration, info)},
                        build={"tokenmill": tokenmill.__version__, "seconds": round(time.monotonic() - started, 1),
                               "prompts": {kind: {part: len(v) for part, v in parts.items()} for kind, parts in sets.items()},
                               "filtered_train": {"refuse": len(refuse_train), "comply": len(comply_train)},
                               "baseline": baseline, "options": {k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in asdict(options).items()}},
                        candidates={options.name: torch.stack([directions[layer][chosen.position] for layer in layers])})
    save_steering_file(options.out, file)
    return BuildReport(file, baseline, shortlist, chosen, time.monotonic() - started)


def _calibrate(engine: LLMEngine, sets: dict[str, dict[str, list[list[int]]]], verdicts: dict[str, dict[str, list[bool]]],
               tokens: int) -> DetectorCalibration | None:
    """The detector's threshold and scale: mean projections at strength 0 of validation answers the
    baseline refused and answered (None when either group has fewer than two)."""
    prompts = sets["refuse"]["val"] + sets["comply"]["val"]
    flags = verdicts["refuse"]["val"] + verdicts["comply"]["val"]
    answers = generate(engine, prompts, tokens)
    means = [sum(a.projections) / len(a.projections) if a.projections else math.nan for a in answers]
    refused = torch.tensor([m for m, f in zip(means, flags) if f and math.isfinite(m)], dtype=torch.float64)
    answered = torch.tensor([m for m, f in zip(means, flags) if not f and math.isfinite(m)], dtype=torch.float64)
    if len(refused) < 2 or len(answered) < 2:
        return None
    pooled = math.sqrt((float(refused.var()) + float(answered.var())) / 2)
    r_mean, a_mean = float(refused.mean()), float(answered.mean())
    return DetectorCalibration(tokens, (r_mean + a_mean) / 2, max(pooled, 1e-6), r_mean, a_mean)


def summary(report: BuildReport) -> dict[str, Any]:
    chosen = report.chosen
    direction = next(iter(report.file.directions.values()))
    return {"layer": direction.layer, "position": direction.info["positions"]["chosen"],
            "refusal_rate_strength_0": report.baseline["refuse_val_refusal_rate"],
            "refusal_rate_strength_1": None if chosen is None else chosen.refusal_rate,
            "comply_kl": None if chosen is None else chosen.comply_kl, "seconds": round(report.seconds, 1),
            "detector": None if direction.calibration is None else asdict(direction.calibration)}

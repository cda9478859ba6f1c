"""FP8 KV-cache scales at start-up: the runner's side of quantization/kv_scales.py — which text the
calibration forward reads, and running that forward into scratch caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.data import shipped_corpus_text
from tokenmill.errors import ConfigError
from tokenmill.layers.step_context import StepContext
from tokenmill.models.interface import CausalLM
from tokenmill.models.loader import CheckpointSource, load_tokenizer
from tokenmill.quantization.kv_scales import CALIBRATION_TOKENS, recorded_cache_amax, set_kv_scales
from tokenmill.runner.batch import Chunk, pack

if TYPE_CHECKING:
    from tokenmill.runner.model_runner import ModelRunner

_RANDOM_IDS_SEED = 0


def configure_kv_scales(runner: ModelRunner, source: CheckpointSource) -> None:
    """Give every FP8-capable cache layer of the target the scales it serves with (before CUDA graphs)."""
    model = runner.model
    budget = min(CALIBRATION_TOKENS, runner.config.model.max_model_len, runner.config.scheduler.max_num_batched_tokens)

    plan = runner.cache_plan
    state_slot = plan.scratch_slot if plan.bytes_per_state_slot else None  # a hybrid's recurrent layers write there

    def measure() -> tuple[list[tuple[float, ...]], int, str]:
        token_ids, what = calibration_token_ids(source, runner.vocab_size, budget)
        amax = measure_kv_amax(model, token_ids, runner.block_size, runner.dtype, runner.device, state_slot)
        return amax, len(token_ids), what

    set_kv_scales(model.scaled_cache_layers(), runner.kv_dtype, runner.config.cache.calculate_kv_scales, measure)


def calibration_token_ids(source: CheckpointSource, vocab_size: int, max_tokens: int) -> tuple[list[int], str]:
    """(token ids, what they are): the corpus text through the model's tokenizer (with its special
    tokens, as a text prompt gets them), else seeded random ids for a model without a tokenizer."""
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(_RANDOM_IDS_SEED)
        return torch.randint(vocab_size, (max_tokens,), generator=generator).tolist(), "seeded random ids (no tokenizer)"
    text = shipped_corpus_text()[: 16 * max_tokens]  # no tokenizer packs more than 16 characters per token
    ids = [t for t in tokenizer(text).input_ids if 0 <= t < vocab_size][:max_tokens]
    return ids, "Newton's Opticks"


@torch.inference_mode()
def measure_kv_amax(
    model: CausalLM, token_ids: list[int], block_size: int, dtype: torch.dtype, device: torch.device,
    state_slot: int | None = None,
) -> list[tuple[float, ...]]:
    """The amax of each scaled cache part (k and v; an MLA latent row) per FP8-capable cache layer
    over one sequence of token_ids, each layer writing a scratch cache in the model dtype; other
    cache layers write their own caches (`state_slot`: the state slot of a model with state)."""
    layers = model.scaled_cache_layers()
    if not token_ids:
        raise ConfigError("the KV-scale calibration text has no tokens")
    blocks = -(-len(token_ids) // block_size)
    specs = [layer.cache_spec() for layer in layers]
    scratch = [torch.zeros(spec.shape(blocks), dtype=dtype, device=device) for spec in specs]
    parts = [spec.scaled_parts(cache) for spec, cache in zip(specs, scratch)]
    ids, positions, metadata = pack([Chunk(token_ids, 0, range(blocks))], block_size, device)
    slots = None if state_slot is None else torch.tensor([state_slot], device=device)
    return recorded_cache_amax(layers, scratch, parts, lambda: model(ids, StepContext(positions, metadata, slots)), dtype)

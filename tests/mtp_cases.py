"""The MTP tests' checkpoints (tests/mtp_models.py's, one per family case), workload and engine."""

from __future__ import annotations

from pathlib import Path

from deepseek_models import MOE, deepseek_config
from hybrid_models import HYBRID_CONFIGS, randomize_hybrid_
from hybrid_models import random_prompts as hybrid_prompts
from mtp_models import MTPCheckpoint, deepseek_mtp_checkpoint, qwen4exp_extras, qwen_mtp_checkpoint
from qwen4exp_models import QWEN4EXP_CONFIGS
from transformers import Qwen4ExpForCausalLM

from tokenmill import LLM

GAMMA = 3
BLOCK = 8


TIED = {"qwen3_next-dense-interval2-half-rotary", "qwen4exp-interval2-sigmoid-one-ple", "deepseek-v3-neox-tied"}


def make_checkpoint(name: str, path: Path, mode: str = "copy") -> MTPCheckpoint:
    """A tied head makes a nearly-bigram target repeat its input token: its blocks are scaled up to break it."""
    scale = (1.5 if name.startswith("deepseek") else 0.6) if name in TIED else None
    if name in HYBRID_CONFIGS:
        return qwen_mtp_checkpoint(name, path, HYBRID_CONFIGS, randomize_hybrid_, mode=mode, scale=scale)
    if name in QWEN4EXP_CONFIGS:
        return qwen_mtp_checkpoint(name, path, QWEN4EXP_CONFIGS, randomize_hybrid_, mode=mode, scale=scale,
                                   make=lambda c: Qwen4ExpForCausalLM(c).float(), layer_type="indexed_attention",
                                   extra_tensors=qwen4exp_extras)
    config = {"deepseek-v3": deepseek_config("v3-moe"),
              "deepseek-v3-neox-tied": deepseek_config("v3-neox", **MOE, norm_topk_prob=True)}[name]
    return deepseek_mtp_checkpoint(config, path, mode=mode, scale=scale)


def vocab_of(name: str) -> int:
    if name in HYBRID_CONFIGS:
        return HYBRID_CONFIGS[name].vocab_size
    if name in QWEN4EXP_CONFIGS:
        return QWEN4EXP_CONFIGS[name].vocab_size
    return 320


def workload(vocab: int) -> list[list[int]]:
    """Prompts of 5 to 70 tokens, two sharing a 41-token prefix (a prefix hit)."""
    prompts = hybrid_prompts((5, 70, 23), seed=7, vocab=vocab)
    shared = hybrid_prompts((41,), seed=8, vocab=vocab)[0]
    return prompts + [shared + [1], shared + [2, 3]]


def engine(path: Path, spec: dict | None, num_blocks: int | None = None, **overrides: object) -> LLM:
    """Blocks of 8, steps of 16 tokens (chunked prefill), three sequences; `num_blocks`: a cache of
    that many blocks beside the state slots (and a snapshot per block for hybrid prefix hits)."""
    settings: dict = dict(device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=3,
                          max_model_len=96, mamba_state_interval=BLOCK, speculative_config=spec)
    settings.update(overrides)
    if num_blocks is None:
        return LLM(str(path), kv_cache_bytes=1 << 22, **settings)
    plan = LLM(str(path), kv_cache_bytes=1 << 22, **settings).engine.runner.cache_plan
    snapshots = 12 if plan.bytes_per_state_slot else 0
    budget = (plan.num_state_slots + 1 + snapshots) * plan.bytes_per_state_slot + num_blocks * plan.bytes_per_block
    return LLM(str(path), kv_cache_bytes=budget, mamba_snapshot_bytes=snapshots * plan.bytes_per_state_slot, **settings)

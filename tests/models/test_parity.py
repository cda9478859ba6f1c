"""Logits parity with transformers' AutoModelForCausalLM: prefill, and decode through the paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import TARGETS, check_parity, tolerance
from tiny_models import TINY_CONFIGS, save_tiny_checkpoint

from tokenmill import LLM


@pytest.mark.parametrize(("device", "dtype"), TARGETS)
@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_tiny_model_logits_match_transformers(arch: str, device: str, dtype: str, tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint(arch, tmp_path)
    # Block size 4 and a 6-token step budget: the prompt is prefilled in chunks across blocks.
    llm = LLM(str(tmp_path), device=device, dtype=dtype, block_size=4, max_num_batched_tokens=6,
              kv_cache_bytes=1 << 22)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf_model.config.vocab_size, (23,), generator=generator).tolist()
    check_parity(llm, hf_model, prompt, steps=20, tol=tolerance(hf_model, prompt, dtype))


@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers(smollm2_llm: LLM, hf_smollm2) -> None:
    hf_model, tokenizer = hf_smollm2
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. In the beginning").input_ids
    check_parity(smollm2_llm, hf_model, prompt, steps=20, tol=1e-4)


@pytest.mark.gpu
def test_smollm2_shaped_model_matches_transformers_cuda_bf16(tmp_path: Path) -> None:
    """SmolLM2-135M's shapes with random weights (the 98 MB GGUF cannot travel to the GPU machine)."""
    hf_model = save_tiny_checkpoint("smollm2-shape", tmp_path)
    prompt = torch.randint(0, 49152, (57,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", kv_cache_bytes=1 << 30)
    check_parity(llm, hf_model, prompt, steps=20, tol=tolerance(hf_model, prompt, "bfloat16"))

"""FP8 E4M3 KV cache: twice the tokens of bf16 in the same bytes, logits close to the exact ones."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams


def test_fp8_doubles_capacity_and_stays_close(tmp_path: Path) -> None:
    hf_model = save_tiny_checkpoint("llama", tmp_path)
    budget = 1 << 20
    bf16 = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_bytes=budget)
    fp8 = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_dtype="fp8", kv_cache_bytes=budget)
    assert fp8.engine.kv.num_blocks == 2 * bf16.engine.kv.num_blocks
    assert fp8.engine.runner.model.model.layers[0].self_attn.kv_cache.dtype == torch.float8_e4m3fn

    prompt = list(range(3, 40))
    seen: list[torch.Tensor] = []
    model = fp8.engine.runner.model
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]  # type: ignore[method-assign]
    out = fp8.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ours = torch.cat(seen).float()
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    # FP8 keeps 3 mantissa bits: close to, but measurably different from, the exact logits.
    assert 1e-5 < err < 5e-2

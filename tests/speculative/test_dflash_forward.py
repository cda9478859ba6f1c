"""The block drafters' forward against a dense reference of upstream's math (tests/dflash_models.py):
every proposal of an engine run (chunked prefill, blocks following verify steps and blocks run
at proposal time) gives the reference's logits at every block position for the request's known
tokens, and DFlash2's selector walks the reference's greedy path; random drafters (no structure
to hide a wrong layout), dense and hybrid targets, float32 on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dflash_models import TARGET_CONFIGS, drafter, reference_block, reference_walk, save_drafter, save_target
from hybrid_models import random_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.speculative.dflash import DFlashProposer

GAMMA = 3


WINDOWED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 9}  # sliding layers causal


@pytest.mark.parametrize("name,kind,attention", [
    ("llama", "dflash", {}), ("llama", "dflash2", {}), ("qwen3_next", "dflash", {}), ("qwen3_moe", "dflash2", {}),
    ("llama", "dflash", WINDOWED), ("llama", "dflash2", {**WINDOWED, "is_causal": False}),
    ("qwen3_moe", "dflash", {"layer_types": ["sliding_attention"] * 2, "sliding_window": 12, "is_causal": True}),
])
def test_every_proposal_is_the_references_block(name: str, kind: str, attention: dict, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding-window layers too (upstream's masks: causal by default, the window both ways when not)."""
    config = TARGET_CONFIGS[name]
    target = save_target(name, tmp_path / "target", repeat=False)
    d = drafter(config, kind, target_layer_ids=(config.num_hidden_layers - 2, 0), block_size=6,
                input_embedding_scale=1.25, output_multiplier=0.8, final_logit_softcapping=30.0, **attention)
    d.config["dflash_config"].update({k: d.config.pop(k) for k in
                                      ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")})
    seen: list[tuple[list[int], tuple[torch.Tensor, ...], list[int]]] = []
    original = DFlashProposer._draft

    def recorded(self, requests, limits, outputs, anchors):
        original(self, requests, limits, outputs, anchors)
        per = [t.view(len(requests), GAMMA, -1) for t in outputs]
        for b, r in enumerate(requests):
            seen.append((list(r.all_token_ids), tuple(t[b].clone() for t in per), r.drafts.device_ids.tolist()))

    monkeypatch.setattr(DFlashProposer, "_draft", recorded)
    llm = LLM(str(tmp_path / "target"), device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=16,
              max_num_seqs=3, max_model_len=96, kv_cache_bytes=1 << 22,
              speculative_config={"method": kind, "model": str(save_drafter(d, tmp_path / "draft")),
                                  "num_speculative_tokens": GAMMA, "draft_sampling": "greedy"})
    llm.generate(random_prompts((5, 29, 18), seed=4, vocab=config.vocab_size), SamplingParams(temperature=0, max_tokens=10))
    assert len(seen) > 10
    for known, outputs, drafts in seen:
        hidden, logits = reference_block(target, d, known, GAMMA + 1)
        cap = 30.0
        logits = torch.tanh(logits * 0.8 / cap) * cap
        if kind == "dflash":
            torch.testing.assert_close(outputs[0], logits, atol=2e-4, rtol=1e-4)
            assert drafts == logits.argmax(-1).tolist()[: len(drafts)]
        else:
            unary, ids, projected, walk = outputs
            top = logits.topk(ids.shape[1], dim=-1)
            torch.testing.assert_close(unary, top.values, atol=2e-4, rtol=1e-4)
            assert torch.equal(ids.sort(-1).values, top.indices.sort(-1).values)
            torch.testing.assert_close(projected, hidden @ d.tensors["candidate_selector.hidden_projection.weight"].T,
                                       atol=2e-4, rtol=1e-4)
            path = reference_walk(d, hidden, logits, known[-1])
            assert drafts == path[: len(drafts)] and walk.view(-1).tolist() == path

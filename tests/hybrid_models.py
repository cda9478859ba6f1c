"""Tiny random Gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE) saved with transformers'
own save_pretrained, and the prompts their tests share.

Every switch of the families is set in some config: value heads = 2 x key heads (a wrong
grouping of Qwen3-Next's packed projections would pass with equal counts) or 3 x, attention
every 4th layer or every 2nd, partial rotary 1/4 or 1/2, dense and sparse layers
(decoder_sparse_step, mlp_only_layers), norm_topk_prob on and off, tied embeddings. The
recurrent parameters get slow decays, so state carried across chunks and steps matters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3NextConfig
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from tokenmill import LLM
from tokenmill.speculative.drafts import DraftingRequest, Drafts

VOCAB = 192
COMMON = dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
           experts_implementation="eager")

HYBRID_CONFIGS: dict[str, PretrainedConfig] = {
    "qwen3_next": Qwen3NextConfig(**COMMON, **MOE, num_hidden_layers=4, intermediate_size=40, norm_topk_prob=True,
                                  partial_rotary_factor=0.25),
    "qwen3_next-dense-interval2-half-rotary": Qwen3NextConfig(
        **{**COMMON, "linear_num_value_heads": 6}, **MOE, num_hidden_layers=4, intermediate_size=40,
        norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3], full_attention_interval=2,
        partial_rotary_factor=0.5, tie_word_embeddings=True),
    "qwen3_5_moe": Qwen3_5MoeTextConfig(**COMMON, **MOE, num_hidden_layers=4, partial_rotary_factor=0.25),
    "qwen3_5": Qwen3_5TextConfig(**COMMON, num_hidden_layers=4, intermediate_size=40, partial_rotary_factor=0.5),
}


@torch.no_grad()
def randomize_hybrid_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights: slow recurrent decays, norms around their identity, the rest small."""
    gen = torch.Generator().manual_seed(seed)
    for param_name, p in model.named_parameters():
        if param_name.endswith("A_log"):  # decay rates exp(A_log) * softplus(a + dt_bias): slow
            p.copy_(torch.empty(p.shape).uniform_(0.02, 0.5, generator=gen).log())
        elif param_name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 2.0)
        elif p.dim() == 1:  # norm weights: (1 + w) norms around 1, the gated norm's w around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in param_name else 0.0))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def save_hybrid(name: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """The named model with seeded random weights, saved by transformers; returned in float32."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(HYBRID_CONFIGS[name], dtype=torch.float32)
    randomize_hybrid_(model, seed)
    model.save_pretrained(directory)
    return model.eval()


class SavedModels(dict):
    """name -> (directory, transformers model), each saved by `save(name, directory)` on first use."""

    def __init__(self, tmp_path_factory, save: Callable[[str, Path], torch.nn.Module]) -> None:
        super().__init__()
        self.tmp_path_factory, self.save = tmp_path_factory, save

    def __missing__(self, name: str) -> tuple[Path, torch.nn.Module]:
        path = self.tmp_path_factory.mktemp(name)
        self[name] = (path, self.save(name, path))
        return self[name]


def random_prompts(lengths: tuple[int, ...], seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation (one full forward per token: no cache to trust)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


class SpoilingProposer:
    """Proposes the reference answer with draft `c` replaced by a wrong token, c = 0, 1, .., limit
    in turn per request (c = limit: every draft right), so verification accepts exactly c drafts."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.answers, self.vocab = answers, vocab
        self.turn: dict[str, int] = {}

    def propose(self, requests: Sequence[DraftingRequest], limits: Sequence[int]) -> None:
        for request, limit in zip(requests, limits):
            answer = self.answers[tuple(request.prompt_token_ids)]
            done = len(request.output_token_ids)
            ids = list(answer[done : done + limit])
            turn = self.turn.get(request.request_id, 0)
            spoiled = turn % (len(ids) + 1)
            self.turn[request.request_id] = turn + 1
            if spoiled < len(ids):
                ids[spoiled] = (ids[spoiled] + 1) % self.vocab
            request.drafts = Drafts(len(ids), host_ids=ids)

    def follow(self, scheduled, sampled, step) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self.turn.pop(request_id, None)
def hybrid_llm(path: Path, **overrides: object) -> LLM:
    """tokenmill on a saved hybrid: float32 on the CPU, blocks of 8 tokens, steps of 48 tokens (long
    prompts prefill in chunks), 4 MiB of cache, four sequences; `overrides` name config fields."""
    settings = dict(device="cpu", dtype="float32", block_size=8, max_num_batched_tokens=48, kv_cache_bytes=1 << 22,
                    max_num_seqs=4)
    return LLM(str(path), **{**settings, **overrides})

"""A Qwen3-Next-shaped Gated-DeltaNet hybrid through tokenmill.LLM on one GPU: decode against the
roofline measured in the same run, BF16 against FP32 recurrent state, and hybrid prefix caching
on a multi-turn chat trace against what the paged KV alone (a pure-attention model) and
block-granular state caching would hit on the same trace.

    python benchmarks/hybrid_engine_bench.py [--layers 24] [--turns 6] [--json out.json]
    python benchmarks/hybrid_engine_bench.py --smoke   # tiny, on CPU: checks the script

The model: Qwen3-Next-80B-A3B's shape (hidden 2048; GDN 16 key / 32 value heads of 128, conv 4;
attention 16 heads / 2 KV heads of 256, rotary on a quarter; 512 experts of 512 top-10 + a
gated shared expert of 512; attention every 4th layer), random weights (load_format=dummy).
Its 48 layers need FP8 weights to fit one H200; --layers (default 24, a multiple of 4) keeps
the per-layer mix in bf16.

1. Check: a tiny Qwen3-Next on CUDA (bf16, Triton GDN kernels, CUDA graphs) against transformers'
   float32 model: greedy tokens and the logits' relative error.
2. Decode bs=1 after 128 tokens: engine tok/s against copy bandwidth / (active weight bytes +
   state bytes read and written + KV bytes), active = every weight but the unselected experts
   and the embedding table's other rows.
3. Decode at batch 64 with --mamba-ssm-cache-dtype bfloat16 and float32: the ratio.
4. Chat trace: conversations sharing a 4k-token system prompt, growing turns (the answers in the
   next prompt), and branches that re-ask from a random point of a conversation (prefixes of any
   length). Sequential requests, as users send them. Reported: hit rate (cached / prompt tokens)
   of the hybrid engine, of its paged KV alone on the same trace (what a pure-attention model
   with the same blocks would hit), their ratio (target >= 0.9); the hit rate one cached state
   per 1,504-token block would give (computed on the trace with an unbounded cache); mean time to
   first token with and without the prefix cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import FigureTable  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kv.planner import bytes_per_block  # noqa: E402

QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
TINY = {**QWEN3_NEXT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096,
        "bos_token_id": 0, "eos_token_id": 1}
# Qwen3-Next-80B-A3B-FP8's layout: 128 x 128 block FP8 everywhere but the head and the routers.
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"]}
VLLM_STATE_BLOCK = 1504  # vLLM's hybrid block with BF16 state (MODELS.md): one cached state per block


def check_tiny(device: str) -> None:
    """Greedy tokens and logits of a tiny Qwen3-Next (Triton kernels on CUDA) against transformers in float32."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    torch.manual_seed(0)
    config = Qwen3NextConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type", "torch_dtype")})
    config.architectures = ["Qwen3NextForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            shift = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            p.copy_(torch.randn(p.shape) * 0.1 + shift)
    prompt = random.Random(3).sample(range(2, 500), 300)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        dtype = "bfloat16" if device == "cuda" else "float32"
        llm = LLM(tmp, device=device, dtype=dtype, max_model_len=1024, kv_cache_bytes=1 << 26, max_num_seqs=4)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    agree = sum(int(ref[i].argmax()) == t for i, t in enumerate(tokens))
    print(f"check: tiny Qwen3-Next on {device} ({dtype}): {agree}/{len(tokens)} greedy tokens equal transformers' "
          "float32 argmax", flush=True)
    assert agree >= len(tokens) * 3 // 4, "the engine's greedy tokens disagree with transformers'"


def chat_trace(rng: random.Random, system: int, conversations: int, turns: int) -> list[tuple[int, int, int]]:
    """(conversation, turn, branch point or -1) in the order users send them: each conversation's
    turns in order, interleaved; after some turns a branch re-asks from a random earlier point."""
    order = []
    for turn in range(turns):
        for conv in range(conversations):
            order.append((conv, turn, -1))
            if turn and rng.random() < 0.5:
                order.append((conv, turn, rng.randrange(system // 2, system + 200 * turn)))
    return order


def run_chat(llm: LLM, seed: int, system_len: int, conversations: int, turns: int, answer: int,
             vocab: int) -> tuple[list[list[int]], list[float], list[int]]:
    """Send the trace one request at a time; (prompts, time to first token, cached tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(system_len)]
    history = {c: list(system) for c in range(conversations)}
    prompts, ttfts, cached = [], [], []
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    for i, (conv, _turn, branch) in enumerate(chat_trace(rng, system_len, conversations, turns)):
        user = [rng.randrange(2, vocab) for _ in range(rng.randrange(30, 300))]
        base = history[conv] if branch < 0 else history[conv][: min(branch, len(history[conv]))]
        prompt = base + user
        engine.add_request(f"r{i}", prompt, params)
        start, first, output = time.perf_counter(), None, []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if first is None and delta.outputs[0].token_ids:
                    first = time.perf_counter() - start
                    cached.append(delta.num_cached_tokens)
                output.extend(delta.outputs[0].token_ids)
        prompts.append(prompt)
        ttfts.append(first or 0.0)
        if branch < 0:
            history[conv] = prompt + output
    return prompts, ttfts, cached


def block_granular_hits(prompts: list[list[int]], block: int) -> int:
    """Tokens a cache of one state per `block` tokens would resume (unbounded, every earlier prompt
    cached): the longest common prefix with an earlier prompt, rounded down to a block, < the length."""
    hits = 0
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            for a, b in zip(prompt, earlier):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        hits += min(best, len(prompt) - 1) // block * block
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="layers of the Qwen3-Next shape (48 needs FP8 weights)")
    parser.add_argument("--fp8", action="store_true", help="128 x 128 block FP8 weights (the 80B's published format)")
    parser.add_argument("--skip-chat", action="store_true", help="decode figures only")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per timed run")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    table = FigureTable(62)
    report = table.report

    check_tiny(device)
    config = dict(TINY) if args.smoke else {**QWEN3_NEXT, "num_hidden_layers": args.layers}
    if args.fp8:
        config["quantization_config"] = FP8_BLOCK
    system_len, answer = (64, 4) if args.smoke else (4096, 64)
    if args.smoke:
        args.conversations, args.turns = 2, 3
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        common = dict(device=device, load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                      max_model_len=2048 if args.smoke else 16384, max_num_seqs=4 if args.smoke else 64,
                      kv_cache_bytes=(1 << 25) if args.smoke else (24 << 30))
        if not args.smoke:
            from gpu_bench import active_weight_bytes, copy_bandwidth, decode_rate

            bandwidth = copy_bandwidth()
            report("device copy bandwidth (read + write)", bandwidth / 1e9, "GB/s")
            rates = {}
            for state in ("float32", "bfloat16"):
                llm = LLM(tmp, **common, mamba_ssm_cache_dtype=state)
                per_slot = llm.engine.runner.cache_plan.bytes_per_state_slot
                if state == "float32":
                    weights = active_weight_bytes(llm, llm.engine.runner.model.embed_tokens.weight)
                    kv = 128 * bytes_per_block(llm.engine.runner.model.cache_specs()) / llm.engine.kv.block_size
                    read = weights + 2 * per_slot + kv
                    report(f"roofline bs=1 @ 128, fp32 state ({read / 1e9:.3f} GB per token)", bandwidth / read, "tok/s")
                    rate = decode_rate(llm, 128, args.tokens)
                    report("decode bs=1 @ 128, fp32 state (engine)", rate, "tok/s", bandwidth / read, "roofline")
                rates[state] = decode_rate(llm, 128, args.tokens, batch=64)
                report(f"decode bs=64 @ 128, {state} state ({per_slot / 2**20:.1f} MiB per request)", rates[state], "tok/s")
                del llm
                torch.cuda.empty_cache()
            report("bf16 / fp32 state, decode bs=64", rates["bfloat16"] / rates["float32"], "x")
        if args.skip_chat:
            table.finish(args.json)
            return
        small = dict(block_size=8, mamba_state_interval=32) if args.smoke else {}
        chat = dict(seed=7, system_len=system_len, conversations=args.conversations, turns=args.turns, answer=answer,
                    vocab=config["vocab_size"])
        llm = LLM(tmp, **common, **small)
        prompts, ttfts, cached = run_chat(llm, **chat)
        stats = llm.engine.stats()
        del llm
        _, cold_ttfts, _ = run_chat(LLM(tmp, **common, **small, enable_prefix_caching=False), **chat)
    total = sum(len(p) for p in prompts)
    queries = stats.prefix_cache_queries
    hybrid, paged = 100 * stats.prefix_cache_hits / queries, 100 * stats.prefix_cache_paged_hits / queries
    report(f"chat trace: {len(prompts)} requests, {total:,} prompt tokens", total, "tokens")
    report("hit rate, hybrid (state snapshots + paged KV)", hybrid, "%", what=f"{sum(cached):,} cached tokens")
    report("hit rate, paged KV alone (pure-attention equivalent)", paged, "%")
    report("hybrid / pure-attention hit rate", hybrid / paged if paged else 0.0, "x", what="target >= 0.9")
    block = 48 if args.smoke else VLLM_STATE_BLOCK
    granular = 100 * block_granular_hits(prompts, block) / total
    report(f"hit rate, one state per {block}-token block (trace, unbounded)", granular, "%")
    report("mean time to first token, prefix cache on", statistics.mean(ttfts) * 1e3, "ms")
    report("mean time to first token, prefix cache off", statistics.mean(cold_ttfts) * 1e3, "ms")
    table.finish(args.json)


if __name__ == "__main__":
    main()

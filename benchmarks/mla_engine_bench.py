"""An MLA model through tokenmill.LLM on one GPU, beside the roofline and the copy bandwidth
measured in the same run: DeepSeek-V2-Lite's shape, or (--model kimi) Kimi-Linear-48B-A3B's.

    python benchmarks/mla_engine_bench.py [--dense] [--tokens 128] [--json out.json]
    python benchmarks/mla_engine_bench.py --model kimi [--layers 27] [--json out.json]
    python benchmarks/mla_engine_bench.py [--model kimi] --smoke   # tiny, on CPU: checks the script

The model: DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads, no q LoRA, latent 512 +
rope 64, q/k head 192, v head 128, YaRN factor 40; layer 0 a dense MLP of 10944, then 64 routed
experts of 1408 top-6 softmax-greedy + 2 shared), random weights (load_format=dummy). --dense:
DENSE MLPs of the shared + active-expert width (2 + 6) x 1408 = 11264 in every layer instead,
the same bytes per decode step without the MoE kernels.

1. Check at the real shape: the engine's logits through the Triton MLA kernels against the same
   weights through the PyTorch MLA reference backend, after a 300-token prefill (up-projected
   path) and after a 13-token chunk behind a prefix-cache hit (absorbed path).
2. Batch-1 decode (engine tok/s, CUDA graphs) at 128 tokens of context (bf16 latent) and at 32k
   (FP8 latent), against the roofline copy bandwidth / (active weight bytes + latent bytes read),
   the active bytes being every weight but the embedding table (one row) and the 58 routed
   experts per MoE layer a token does not select; the captured decode step's device time beside it.
3. Speculative verification: the captured (1 + 4)-token verify step against the 1-token step at
   batch 1 (device time, FP8 latent), at 512 and 32k of context.

--model kimi: Kimi-Linear-48B-A3B's shape (27 layers, hidden 2304; KDA 32 heads of 128, conv 4;
NoPE MLA 32 heads, latent 512 + 64, no q LoRA, in every 4th layer; layer 0 a dense MLP of 9216,
then 256 experts of 1024 top-8 sigmoid + 1 shared; vocab 163840), about 97 GB of bf16 weights at
27 layers (--layers fewer keeps the mix). Part 1 is instead a tiny Kimi-Linear (bf16, Triton KDA
and MLA kernels, CUDA graphs) against transformers' float32 model, skipped where transformers has
no kimi_linear; parts 2 and 3 as above, the roofline's bytes also counting the KDA state each
decode step reads and writes (2x the state slot: recurrent state in float32, conv windows).
"""

from __future__ import annotations

import argparse
import json
import random
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

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "moe_intermediate_size": 1408, "num_experts_per_tok": 6,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rope_theta": 10000,
}
V2_LITE_DENSE = {**V2_LITE, "intermediate_size": (2 + 6) * 1408, "first_k_dense_replace": 27}
TINY = {**V2_LITE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "bos_token_id": 0, "eos_token_id": 1,
        "rope_scaling": {**V2_LITE["rope_scaling"], "original_max_position_embeddings": 64},
        "max_position_embeddings": 2560}
KIMI_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "num_expert_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "model_max_length": 1048576, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
}
KIMI_TINY = {**KIMI_48B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 24,
             "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2,
             "model_max_length": 4096, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
             "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}}
GAMMA = 4
LONG = 32768


def kimi_shape(config: dict, layers: int) -> dict:
    """`layers` layers of the shape, MLA in every 4th (1-indexed 4, 8, ...), KDA elsewhere."""
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    lists = {"kda_layers": [i for i in range(1, layers + 1) if i not in full], "full_attn_layers": full}
    return {**config, "num_hidden_layers": layers, "linear_attn_config": {**config["linear_attn_config"], **lists}}


def check_tiny_kimi(device: str) -> None:
    """Greedy tokens of a tiny Kimi-Linear (Triton KDA and MLA kernels on CUDA) against transformers in float32."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.kimi_linear import KimiLinearConfig  # noqa: F401
    except ImportError:
        print("check: skipped, this transformers has no kimi_linear", flush=True)
        return
    config = kimi_shape(KIMI_TINY, 4)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if p.dim() == 1 and "dt_bias" not in name else 0.0))
        hf.save_pretrained(tmp)
        dtype = "bfloat16" if device == "cuda" else "float32"
        llm = LLM(tmp, device=device, dtype=dtype, max_model_len=1024, kv_cache_bytes=1 << 26, max_num_seqs=4)
        prompt = random.Random(3).sample(range(2, 500), 300)
        tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    agree = sum(int(ref[i].argmax()) == t for i, t in enumerate(tokens))
    print(f"check: tiny Kimi-Linear on {device} ({dtype}): {agree}/{len(tokens)} greedy tokens equal transformers' "
          "float32 argmax", flush=True)
    assert agree >= len(tokens) * 3 // 4, "the engine's greedy tokens disagree with transformers'"


def state_bytes(llm: LLM) -> int:
    """What a decode step reads and writes of one request's recurrent state (KDA): its slot, twice."""
    return 2 * llm.engine.runner.cache_plan.bytes_per_state_slot


def latent_bytes(llm: LLM, context: int) -> float:
    return context * bytes_per_block(llm.engine.runner.model.cache_specs()) / llm.engine.kv.block_size


def last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logits after `prompt` (one eager prefill: every chunk's logits pass compute_logits)."""
    seen: list[torch.Tensor] = []
    model = llm.engine.runner.model
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]  # type: ignore[method-assign]
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    finally:
        del model.compute_logits
    return seen[-1][-1].float().cpu()


def check(model_dir: str, common: dict, device: str) -> None:
    """The Triton kernels' logits against the PyTorch MLA reference's, same weights, both paths."""
    rng = random.Random(5)
    prompt = [rng.randrange(100, 100000 if device == "cuda" else 500) for _ in range(300)]
    logits = {}
    for backend in ("triton", "torch") if device == "cuda" else ("torch", "torch"):
        llm = LLM(model_dir, **common, attention_backend=backend, enforce_eager=True)
        logits[backend] = [last_logits(llm, prompt), last_logits(llm, prompt + [7])]
        assert llm.engine.stats().prefix_cache_hits >= 288
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    for i, path in enumerate(("up-projected prefill of 300", "absorbed 13-token chunk after a prefix hit")):
        ours, ref = logits["triton" if device == "cuda" else "torch"][i], logits["torch"][i]
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        print(f"check {path}: relative logits error {err:.2e} (Triton kernels vs PyTorch reference)", flush=True)
        assert err < 3e-2, "the MLA kernels' logits differ from the reference's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("v2-lite", "kimi"), default="v2-lite")
    parser.add_argument("--layers", type=int, default=27, help="--model kimi: layers of the shape (27: all)")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per timed run")
    parser.add_argument("--dense", action="store_true",
                        help="dense MLPs of the shared + active-expert width instead of V2-Lite's MoE layers")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (the check only)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    table = FigureTable()
    report = table.report

    kimi = args.model == "kimi"
    config = TINY if args.smoke else V2_LITE_DENSE if args.dense else V2_LITE
    if kimi:
        config = kimi_shape(KIMI_TINY, 4) if args.smoke else kimi_shape(KIMI_48B, args.layers)
        print(f"model: Kimi-Linear-48B-A3B shape, {config['num_hidden_layers']} layers (KDA; NoPE MLA every 4th; "
              "layer 0 dense, then 256 experts top-8 + 1 shared)", flush=True)
    elif args.dense:
        print("model: DeepSeek-V2-Lite attention shape with DENSE MLPs of the shared + active-expert width "
              f"({V2_LITE_DENSE['intermediate_size']}) in all 27 layers, not its MoE layers", flush=True)
    else:
        print("model: DeepSeek-V2-Lite shape (MLA; layer 0 dense, then 64 routed experts top-6 + 2 shared)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        common = dict(device=device, load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                      max_model_len=LONG + 1024 if not args.smoke else 512, max_num_seqs=4,
                      kv_cache_bytes=(4 << 30) if not args.smoke else (1 << 24))
        if kimi:
            check_tiny_kimi(device)
            if args.smoke:
                LLM(tmp, **common).generate([[5] * 40], SamplingParams(temperature=0, max_tokens=4))
        else:
            check(tmp, common, device)
        if args.smoke:
            print(f"smoke run done in {time.perf_counter() - table.began:.0f} s")
            return
        from gpu_bench import active_weight_bytes, copy_bandwidth, decode_rate
        from spec_bench import graph_step_ms

        bandwidth = copy_bandwidth()
        report("device copy bandwidth (read + write)", bandwidth / 1e9, "GB/s")
        rng = random.Random(6)
        long_prompt = [rng.randrange(1000, 100000) for _ in range(LONG)]
        for label, kv_dtype, context in (("bf16 latent", "auto", 128), ("FP8 latent", "fp8", LONG)):
            llm = LLM(tmp, **common, kv_cache_dtype=kv_dtype)
            model = llm.engine.runner.model
            weights = active_weight_bytes(llm, getattr(model, "model", model).embed_tokens.weight)
            state = state_bytes(llm)
            if kv_dtype == "auto":
                report("active weight bytes", weights / 1e9, "GB")
                if state:
                    report("recurrent state read + written per decode step", state / 1e9, "GB")
            read = weights + latent_bytes(llm, context) + state
            roofline = bandwidth / read
            report(f"roofline bs=1 @ {context}, {label} ({read / 1e9:.3f} GB per token)", roofline, "tok/s")
            prompt = long_prompt[:context]
            rate = decode_rate(llm, context, args.tokens, prompt=prompt)
            report(f"decode bs=1 @ {context}, {label} (engine)", rate, "tok/s", roofline, "roofline")
            step_ms = graph_step_ms(llm.engine.runner.graphs[0], 1, context)
            report(f"  captured decode step @ {context} (device)", 1e3 / step_ms, "tok/s", roofline, "roofline")
            del llm
            torch.cuda.empty_cache()
        spec = LLM(tmp, **common, kv_cache_dtype="fp8", speculative_config={"method": "ngram",
                                                                              "num_speculative_tokens": GAMMA})
        decode, verify = spec.engine.runner.graphs
        for context in (512, LONG):
            one, many = graph_step_ms(decode, 1, context), graph_step_ms(verify, 1, context)
            report(f"verify (1+{GAMMA}) / 1-token step, bs=1 @ {context}, FP8 latent", many / one, "x",
                   what=f"{many:.3f} / {one:.3f} ms (target <= 1.15x)")
        del spec, decode, verify
    table.finish(args.json)


if __name__ == "__main__":
    main()

"""Qwen3-30B-A3B's shape through the whole engine on one GPU, each figure beside its same-run ceiling.

    python benchmarks/moe_gpu_bench.py [--quick] [--only check,tg,decode,pp,throughput,hf] [--json out.json]
    python benchmarks/moe_gpu_bench.py --smoke        # a tiny model on CPU: checks the script, times nothing real

Builds a random bf16 model of Qwen3-30B-A3B's shape through tokenmill.LLM (load_format=dummy:
hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of intermediate 768, vocab
151,936), measures copy bandwidth and bf16 matmul, then:

- check: layer 0's MoE block (routing + fused experts) against the float32 reference on the
  same weights and routing, at T = 1, 16, 64, 2048.
- tg128: decode at batch 1 after a 128-token prompt, (t(N+1) - t(1)) / N, against the roofline
  of the bytes a token reads: every weight but the experts and the embedding (attention, router,
  norms, lm_head), the selected experts, one embedding row, and the KV of its context.
- decode at batch 16 and 64: the same, the roofline from the experts the batch actually selects
  per step: counted on the device in an eager pass of the same workload (a pre-hook on each
  layer's experts; hooks do not run in graph replays), outside the timed runs.
- pp2048: one cold 2048-token prefill against the bf16 matmul ceiling on its active FLOPs
  (attention, router and k experts per token, causal attention scores).
- throughput: nano-vllm's workload (inputs and outputs uniform in [100, 1024], ignore EOS).
- memory: peak GPU bytes of the engine, KV capacity at the configured KV bytes.
- hf: one fixed workload (inputs uniform in [100, 1024], 256 new tokens each, greedy) through
  tokenmill and through transformers' own Qwen3MoeForCausalLM (random weights, its default
  experts implementation, generate() on a left-padded batch: one max_new_tokens per call), after
  the engine is freed: the ratio.

Prints a table last. GPU memory stays under ~100 GB (weights 61 GB + 16 GiB of KV, then the
engine is freed before transformers builds its copy).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from an uninstalled checkout

from gpu_bench import copy_bandwidth, decode_rate, matmul_flops, offline_throughput, prefill_rate  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.kv.planner import bytes_per_block  # noqa: E402
from tokenmill.layers.linear import Linear  # noqa: E402
from tokenmill.layers.moe import FusedMoE, SparseMoeBlock, fused_experts_ref, select_experts  # noqa: E402
from tokenmill.models.llama import head_dim_of  # noqa: E402

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
# random_prompt draws ids in [1000, 100000): the smoke model's vocabulary holds them.
SMOKE = {**QWEN3_30B_A3B, "vocab_size": 100352, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
         "num_experts_per_tok": 2, "torch_dtype": "float32"}
TARGETS = {"tg128": 0.85, "decode": 0.75, "pp2048": 0.50}  # issue 21's fractions of the rooflines


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: str
    config: dict
    kv_cache_bytes: int
    decode_tokens: int
    prefill_tokens: int
    throughput_requests: int
    hf_requests: int
    hf_new_tokens: int
    check_tokens: tuple[int, ...]


FULL = Setup("cuda", "bfloat16", QWEN3_30B_A3B, 16 << 30, 128, 2048, 256, 16, 256, (1, 16, 64, 2048))
QUICK = Setup("cuda", "bfloat16", QWEN3_30B_A3B, 16 << 30, 32, 2048, 64, 8, 64, (1, 64, 2048))
SMOKE_SETUP = Setup("cpu", "float32", SMOKE, 1 << 26, 4, 64, 0, 2, 4, (1, 20))  # no throughput: outputs of ~1k tokens


class ModelBytes:
    """What the built model reads and computes, from its own modules (numbers only: no reference to
    the model outlives the engine)."""

    def __init__(self, llm: LLM) -> None:
        model = llm.engine.runner.model
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
        self.sparse_layers = len(experts)
        self.expert_bytes = sum(p[0].numel() * p.element_size() for p in experts[0].parameters())
        self.top_k = block.routing.top_k
        embedding = model.model.embed_tokens.weight
        self.row_bytes = embedding.shape[1] * embedding.element_size()
        self.total = sum(p.numel() * p.element_size() for p in model.parameters())
        experts_total = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
        self.dense_bytes = self.total - experts_total - embedding.numel() * embedding.element_size()
        # Matmul parameters a prompt token passes through (the head runs for the last token only).
        self.token_params = sum(m.weight.numel() for name, m in model.named_modules()
                                if isinstance(m, Linear) and name != "lm_head")
        self.token_params += self.sparse_layers * self.top_k * sum(p[0].numel() for p in experts[0].parameters())
        config = llm.engine.runner.hf_config
        self.attention_width = config.num_attention_heads * head_dim_of(config)
        self.layers = config.num_hidden_layers
        self.kv_bytes_per_token = bytes_per_block(model.cache_specs()) / llm.engine.kv.block_size

    def step_bytes(self, batch: int, selected_experts: float, mean_context: float) -> float:
        """Bytes one decode step of `batch` tokens reads, `selected_experts` summed over the layers."""
        return (self.dense_bytes + batch * self.row_bytes + selected_experts * self.expert_bytes
                + batch * mean_context * self.kv_bytes_per_token)

    def prefill_flops(self, tokens: int) -> float:
        """Matmul FLOPs of a causal prefill: 2 per active parameter per token, plus QK^T and PV."""
        return 2 * tokens * self.token_params + 4 * self.layers * self.attention_width * tokens * (tokens + 1) / 2


def selected_experts_per_step(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int = 0) -> float:
    """Mean over the decode steps of a workload like decode_rate's of the experts selected, summed
    over the layers: counted on the device in an eager pass (no graph replay), one host read at the end."""
    runner = llm.engine.runner
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    counts: list[torch.Tensor] = []

    def count(module: FusedMoE, args: tuple) -> None:
        ids = args[2]
        if ids.shape[0] == batch:  # a decode step of the whole batch (the prompts have prompt_len tokens each)
            seen = torch.zeros(module.num_experts, dtype=torch.int32, device=ids.device)
            seen[ids.reshape(-1).long()] = 1
            counts.append(seen.sum())

    handles = [m.register_forward_pre_hook(count) for m in experts]
    graphs, runner.graphs = runner.graphs, []
    try:
        rng = random.Random(seed)
        prompts = [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    finally:
        runner.graphs = graphs
        for handle in handles:
            handle.remove()
    steps = len(counts) / len(experts)
    return float(torch.stack(counts).sum()) / steps


def check_layer(llm: LLM, tokens: int) -> float:
    """Relative error of layer 0's fused MoE block against the float32 reference on its routing."""
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    w13, w2 = block.experts.dequantized_weights()
    gen = torch.Generator(device=w13.device).manual_seed(tokens)
    x = torch.randn(tokens, block.hidden_size, device=w13.device, generator=gen).to(block.gate.weight.dtype)
    with torch.inference_mode():
        actual = block(x).float()
        weights, ids = select_experts(block.gate(x), block.routing, block.gate.e_score_correction_bias)
        expected = fused_experts_ref(x.float(), w13, w2, weights, ids)
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def transformers_rate(config_dir: str, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, str]:
    """Output tok/s of transformers' Qwen3MoeForCausalLM generate() on the left-padded batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32).eval()
    impl = str(getattr(hf.config, "_experts_implementation", None) or getattr(hf.config, "experts_implementation", "?"))
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, **kwargs)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - longest) * len(prompts)
    del hf, out
    gc.collect()
    return produced / seconds, impl


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU (checks the script)")
    parser.add_argument("--only", default="check,tg,decode,pp,throughput,hf", help="comma-separated parts")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    s = SMOKE_SETUP if args.smoke else QUICK if args.quick else FULL
    only = set(args.only.split(","))
    began = time.perf_counter()
    rows: list[tuple[str, str, str, str]] = []
    figures: dict[str, float] = {}
    failures: list[str] = []

    def report(name: str, value: float, unit: str, ceiling: float | None = None, target: float | None = None) -> None:
        figures[name] = value
        ratio = f"{value / ceiling:.1%}" if ceiling else ""
        verdict = "" if target is None or not ceiling else ("ok" if value / ceiling >= target else f"below {target:.0%}")
        rows.append((name, f"{value:,.1f} {unit}", f"{ceiling:,.1f}" if ceiling else "", f"{ratio} {verdict}".strip()))
        print(f"{name:<48} {value:>14,.1f} {unit:<8} {ratio} {verdict}", flush=True)

    if s.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        bandwidth, flops = copy_bandwidth(), matmul_flops()
    else:  # the smoke run: gpu_bench's timers synchronise CUDA, which a CPU run has none of
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        bandwidth, flops = 1e10, 1e11
    report("device copy bandwidth (read + write)", bandwidth / 1e9, "GB/s")
    report("bf16 matmul 8192^3", flops / 1e12, "TFLOP/s")

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(s.config))
        llm = LLM(tmp, device=s.device, dtype=s.dtype, load_format="dummy", kv_cache_bytes=s.kv_cache_bytes,
                  max_model_len=4096)
        shape = ModelBytes(llm)
        report("weights", shape.total / 1e9, "GB")
        report("one expert (gate + up + down)", shape.expert_bytes / 1e6, "MB")
        if "check" in only:
            for tokens in s.check_tokens:
                error = check_layer(llm, tokens)
                ok = error <= (2e-2 if s.dtype == "bfloat16" else 1e-4)
                failures += [] if ok else [f"MoE layer at T={tokens}: relative error {error:.1e}"]
                report(f"check: MoE layer T={tokens} rel. error ({'ok' if ok else 'MISMATCH'})", error, "")
        n = s.decode_tokens
        if "tg" in only:
            selected = selected_experts_per_step(llm, 1, 128, n)
            roofline = bandwidth / shape.step_bytes(1, selected, 128 + n / 2)
            report("active bytes per token (bs=1)", shape.step_bytes(1, selected, 128 + n / 2) / 1e9, "GB")
            report("tg128: decode bs=1 after 128 tokens", decode_rate(llm, 128, n), "tok/s", roofline, TARGETS["tg128"])
        if "decode" in only:
            for batch in (16, 64):
                selected = selected_experts_per_step(llm, batch, 128, n)
                per_layer = selected / shape.sparse_layers
                roofline = batch * bandwidth / shape.step_bytes(batch, selected, 128 + n / 2)
                report(f"decode bs={batch}: experts selected per layer per step", per_layer, "")
                report(f"decode bs={batch} after 128 tokens", decode_rate(llm, 128, n, batch), "tok/s", roofline,
                       TARGETS["decode"])
        if "pp" in only:
            ceiling = flops / (shape.prefill_flops(s.prefill_tokens) / s.prefill_tokens)
            report(f"pp{s.prefill_tokens}: prefill cold", prefill_rate(llm, s.prefill_tokens,
                                                                      repeats=15 if s.device == "cuda" else 1),
                   "tok/s", ceiling, TARGETS["pp2048"])
        if "throughput" in only and s.throughput_requests:
            rate, seconds = offline_throughput(llm, s.throughput_requests)
            report(f"offline throughput, {s.throughput_requests} requests ({seconds:.0f} s)", rate, "tok/s")
        rng = random.Random(3)
        hf_prompts = [[rng.randrange(1000, 100000) for _ in range(rng.randint(100, 1024))] for _ in range(s.hf_requests)]
        if "hf" in only:
            params = SamplingParams(temperature=0, max_tokens=s.hf_new_tokens, ignore_eos=True)
            llm.generate(hf_prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            sync(s.device)
            start = time.perf_counter()
            produced = sum(len(o.outputs[0].token_ids) for o in llm.generate(hf_prompts, params))
            sync(s.device)
            ours = produced / (time.perf_counter() - start)
            report(f"same workload ({s.hf_requests} x {s.hf_new_tokens} tokens): tokenmill", ours, "tok/s")
        if s.device == "cuda":
            report("peak GPU memory (engine)", torch.cuda.max_memory_allocated() / 1e9, "GB")
        kv = llm.engine.kv
        report(f"KV capacity @ {s.kv_cache_bytes / 2**30:.0f} GiB", kv.num_blocks * kv.block_size, "tokens")
        del llm
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()
            print(f"engine freed: {torch.cuda.memory_allocated() / 1e9:.1f} GB still allocated", flush=True)
        if "hf" in only:
            theirs, impl = transformers_rate(tmp, hf_prompts, s.hf_new_tokens, s.device)
            report(f"same workload: transformers generate (experts: {impl})", theirs, "tok/s")
            report("tokenmill / transformers", ours / theirs, "x")
            if s.device == "cuda":
                report("peak GPU memory (whole run)", torch.cuda.max_memory_allocated() / 1e9, "GB")

    print(f"\n{time.perf_counter() - began:.0f} s\n\n| figure | value | ceiling | ratio |\n|---|---|---|---|")
    for name, value, ceiling, ratio in rows:
        print(f"| {name} | {value} | {ceiling} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if failures:
        sys.exit("; ".join(failures))


if __name__ == "__main__":
    main()

"""Engine speed on one GPU, each figure beside the ceiling measured in the same run.

Builds a random-weight checkpoint of Llama-3.1-8B shape (config only; weights are seeded
random, `load_format="dummy"`), measures the device's copy bandwidth and bf16 matmul rate,
then runs tokenmill on the workloads of ../shared/BENCHMARKS.md §1 and prints one table.

    python benchmarks/gpu_bench.py [--quick] [--only tg,pp,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kv.planner import bytes_per_block

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "rope_theta": 500000.0,
}


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replay_seconds(replay: Callable[[], object], repeats: int = 20) -> float:
    """Median device seconds of one call of `replay` (a CUDA graph's replay), timed by events after a warm-up."""
    replay()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3


def graph_time(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of one replay of fn captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return replay_seconds(graph.replay, repeats)


def copy_seconds(time_fn: Callable[[Callable[[], object]], float], dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of dst.copy_(src) for a copy ceiling: timed eagerly on CUDA, where the copy runs as
    a kernel on the multiprocessors (captured in a CUDA graph it becomes a memcpy node on the copy
    engines, about two thirds as fast), else with time_fn."""
    if src.is_cuda:
        return median_time(lambda: dst.copy_(src), repeats=10)
    return time_fn(lambda: dst.copy_(src))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / seconds


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    seconds = median_time(lambda: a @ b, repeats=10)
    return 2 * 8192**3 / seconds


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())


def active_weight_bytes(llm: LLM, embedding: torch.Tensor) -> int:
    """What one token's decode step reads of the weights: every parameter but the embedding table
    (one row of it) and the routed experts it does not select (top_k of each MoE layer's)."""
    from tokenmill.layers.moe import SparseMoeBlock

    unselected = 0
    for block in (m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)):
        experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
        unselected += experts * (block.routing.num_experts - block.routing.top_k) // block.routing.num_experts
    return weight_bytes(llm) - unselected - embedding.numel() * embedding.element_size() + embedding[0].nbytes


def random_prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


def decode_rate(
    llm: LLM, prompt_len: int, new_tokens: int, batch: int = 1, seed: int = 0, prompt: list[int] | None = None,
) -> float:
    """Decode tok/s (per batch) as (t(N+1) - t(1)) / N, so prefill is excluded (a draft model's pass
    over the prompt too: it runs behind the target's prefill). Prompts are fresh random ones each
    run, or `prompt` every time (then prefix-cache hits cancel out too)."""
    rng = random.Random(seed)

    def run(n: int) -> float:
        prompts = [prompt or random_prompt(prompt_len, rng) for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4), run(4)  # the second warm-up takes the prefix-cache path a fixed prompt takes from then on
    one = statistics.median(run(1) for _ in range(3))
    many = statistics.median(run(new_tokens + 1) for _ in range(3))
    return batch * new_tokens / (many - one)


def prefill_rate(llm: LLM, tokens: int, depth: int = 0, seed: int = 1, repeats: int = 15) -> float:
    """tokens / the median time of `repeats` cold prefills (three were too few to see 2%)."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1)
    context = random_prompt(depth, rng)

    def run() -> float:
        if depth:
            llm.generate([context], params)  # the depth is cached; only `tokens` new ones are computed
        prompt = context + random_prompt(tokens, rng)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run()
    return tokens / statistics.median(run() for _ in range(repeats))


def offline_throughput(llm: LLM, num_requests: int, seed: int = 2) -> tuple[float, float]:
    """nano-vllm's workload: input and output lengths uniform in [100, 1024], ignore EOS."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng.randint(100, 1024), rng) for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(100, 1024), ignore_eos=True) for _ in prompts]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return sum(p.max_tokens for p in params) / seconds, seconds


def same_workload_vs_transformers(llm: LLM, config_dir: str, num_requests: int, seed: int = 3) -> tuple[float, float]:
    """Output tok/s of tokenmill and of transformers' generate_batch (continuous batching) on one
    workload: inputs uniform in [100, 1024], 1024 new tokens each, greedy (generate_batch takes
    one max_new_tokens for the whole batch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    rng = random.Random(seed)
    prompts = [random_prompt(rng.randint(100, 1024), rng) for _ in range(num_requests)]
    new_tokens = 1024
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16).cuda().eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(prompts[:4], generation_config=config, max_new_tokens=8)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = hf.generate_batch(prompts, generation_config=config)
    torch.cuda.synchronize()
    theirs = sum(len(r.generated_tokens) for r in results.values()) / (time.perf_counter() - start)
    del hf
    torch.cuda.empty_cache()
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests (a smoke run)")
    parser.add_argument("--only", default="tg,pp,depth,throughput,capacity,hf", help="comma-separated workloads")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    only = set(args.only.split(","))
    rows: list[tuple[str, str, str]] = []
    figures: dict[str, float] = {}

    def report(name: str, value: float, unit: str, ceiling: float | None = None, ceiling_name: str = "") -> None:
        figures[name] = value
        ratio = f"{100 * value / ceiling:.1f}% of {ceiling_name}" if ceiling else ""
        rows.append((name, f"{value:,.1f} {unit}", ratio))
        print(f"{name:<42} {value:>12,.1f} {unit:<8} {ratio}", flush=True)

    bandwidth, flops = copy_bandwidth(), matmul_flops()
    report("device copy bandwidth", bandwidth / 1e9, "GB/s")
    report("bf16 matmul 8192^3", flops / 1e12, "TFLOP/s")

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_31_8B))
        common = dict(load_format="dummy", dtype="bfloat16", attention_backend=args.attention_backend,
                      enforce_eager=args.enforce_eager, max_model_len=36 * 1024)
        llm = LLM(tmp, kv_cache_bytes=40 << 30, **common)
        weights = weight_bytes(llm)
        roofline = bandwidth / weights
        flops_per_token = 2 * weights / 2  # 2 FLOPs per bf16 parameter
        report("weights", weights / 1e9, "GB")
        report("bs=1 decode roofline", roofline, "tok/s")
        n = 32 if args.quick else 128
        if "tg" in only:
            report("tg128: decode bs=1 after 128 tokens", decode_rate(llm, 128, n), "tok/s", roofline, "roofline")
            for batch in (16, 64):
                report(f"decode bs={batch} after 128 tokens", decode_rate(llm, 128, n, batch), "tok/s")
        if "pp" in only:
            report("pp2048: prefill 2048 cold", prefill_rate(llm, 2048), "tok/s", flops / flops_per_token, "matmul ceiling")
        if "depth" in only:
            report("pp2048 @ d4096", prefill_rate(llm, 2048, depth=4096), "tok/s", flops / flops_per_token, "matmul ceiling")
            report("tg @ d4096 bs=1", decode_rate(llm, 4096, n), "tok/s", roofline, "weight roofline")
        if "throughput" in only:
            rate, seconds = offline_throughput(llm, 32 if args.quick else 256)
            report(f"offline throughput ({seconds:.0f} s)", rate, "tok/s")
        if "hf" in only:
            ours, theirs = same_workload_vs_transformers(llm, tmp, 16)
            report("same workload: tokenmill", ours, "tok/s")
            report("same workload: HF generate_batch", theirs, "tok/s")
            report("tokenmill / HF generate_batch", ours / theirs, "x")
        if "capacity" in only:
            report("KV capacity bf16 @ 40 GiB", llm.engine.kv.num_blocks * llm.engine.kv.block_size, "tokens")
        del llm
        torch.cuda.empty_cache()
        if "depth" in only:
            fp8 = LLM(tmp, kv_cache_bytes=40 << 30, kv_cache_dtype="fp8", **common)
            report("KV capacity fp8 @ 40 GiB", fp8.engine.kv.num_blocks * fp8.engine.kv.block_size, "tokens")
            depth = 8192 if args.quick else 32768
            kv_bytes = depth * bytes_per_block(fp8.engine.runner.model.cache_specs()) / fp8.engine.kv.block_size
            report(f"tg @ d{depth} bs=1, fp8 KV", decode_rate(fp8, depth, n), "tok/s",
                   bandwidth / (weights + kv_bytes), "weight+KV roofline")

    print("\n| figure | value | ratio |\n|---|---|---|")
    for name, value, ratio in rows:
        print(f"| {name} | {value} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

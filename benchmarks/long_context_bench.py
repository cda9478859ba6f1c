"""Long-context rows on one GPU, each beside its ceiling measured in the same run.

Llama-3.1-8B shape, random weights (`load_format="dummy"`), FP8 KV cache. Parts (`--only`):

  ceilings  device copy bandwidth and bf16 matmul rate (every part's ceilings come from these)
  d32k, d100k, d260k
            at that depth: the cold prefill of the context (time to first token), pp2048 on top of
            the cached context, and tg (decode tok/s) at that depth. Prefill ceiling: attention +
            linear FLOPs at the matmul rate; decode ceiling: weight + KV bytes per token at copy
            bandwidth
  itl       p50 / p99 / max inter-token latency of a decoding stream while a 260k prompt is
            prefilled beside it (the scheduler's step-cost rule); itl-tokens: the same with
            --prefill-attention-depth 0 (tokens only: the rule before it)
  startup   `tokenmill serve` of the 8B shape to /health 200 and to its first token, decode
            graphs captured eagerly and lazily

    python benchmarks/long_context_bench.py --only ceilings,d32k [--json out.json]
    python benchmarks/long_context_bench.py --smoke      # a tiny shape on the CPU, every part but startup

Every part prints its rows as it ends and a table last; `--json` keeps every figure.
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
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kv.planner import bytes_per_block
from tokenmill.models.step_cost import attention_flops_per_key, linear_flops_per_token

LLAMA_31_8B_262K = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    # The published model stops at 131072 positions; random weights run any, and 260k is the row asked for.
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001, "rope_theta": 500000.0,
}
TINY = {**LLAMA_31_8B_262K, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
DEPTHS = {"d32k": 32768, "d100k": 100_000, "d260k": 260_000}  # multiples of the block size: the context caches whole
SMOKE_DEPTHS = {"d32k": 512, "d100k": 1024, "d260k": 2048}


class Bench:
    def __init__(self, smoke: bool, config_dir: str) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.config_dir = config_dir
        self.depths = SMOKE_DEPTHS if smoke else DEPTHS
        self.pp = 128 if smoke else 2048
        self.rows: list[tuple[str, str, str]] = []
        self.figures: dict[str, float] = {}
        self.bandwidth = self.flops = 0.0
        self._llm: LLM | None = None

    def report(self, name: str, value: float, unit: str, ceiling: float | None = None, ceiling_name: str = "") -> None:
        self.figures[name] = value
        ratio = f"{100 * value / ceiling:.1f}% of {ceiling:,.1f} {ceiling_name}" if ceiling else ""
        self.rows.append((name, f"{value:,.2f} {unit}", ratio))
        print(f"{name:<50} {value:>14,.2f} {unit:<8} {ratio}", flush=True)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def engine_args(self, **overrides: Any) -> dict[str, Any]:
        if self.smoke:
            common = dict(device="cpu", dtype="float32", max_model_len=4096, kv_cache_bytes=256 << 20,
                          max_num_batched_tokens=256)
        else:
            common = dict(dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=262144, kv_cache_bytes=40 << 30,
                          max_num_seqs=8, cuda_graph_capture="lazy")
        return {"load_format": "dummy", **common, **overrides}

    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(self.config_dir, **self.engine_args())
        return self._llm

    def drop_llm(self) -> None:
        self._llm = None
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ---- ceilings ---------------------------------------------------------------------------

    def ceilings(self) -> None:
        n = 1 << (24 if self.smoke else 30)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        copy = statistics.median(self.timed(lambda: dst.copy_(src)) for _ in range(10))
        self.bandwidth = 2 * n / copy
        size = 1024 if self.smoke else 8192
        dtype = torch.float32 if self.smoke else torch.bfloat16
        a = torch.randn(size, size, dtype=dtype, device=self.device)
        b = torch.randn(size, size, dtype=dtype, device=self.device)
        self.timed(lambda: a @ b)
        self.flops = 2 * size**3 / statistics.median(self.timed(lambda: a @ b) for _ in range(10))
        self.report("device copy bandwidth", self.bandwidth / 1e9, "GB/s")
        self.report(f"matmul {size}^3 ({dtype})", self.flops / 1e12, "TFLOP/s")

    def need_ceilings(self) -> None:
        if not self.flops:
            self.ceilings()

    # ---- depth rows ---------------------------------------------------------------------------

    def prefill_flops(self, new: int, depth: int) -> float:
        """Linear FLOPs of `new` tokens plus their causal attention over depth + their own keys."""
        model = self.llm().engine.runner.model
        keys = new * depth + new * (new + 1) / 2
        return linear_flops_per_token(model) * new + attention_flops_per_key(model) * keys

    def depth_rows(self, part: str) -> None:
        self.need_ceilings()
        depth = self.depths[part]
        llm = self.llm()
        rng = random.Random(depth)
        vocab = llm.engine.hf_config.vocab_size
        context = [rng.randrange(10, vocab) for _ in range(depth)]
        once = SamplingParams(temperature=0, max_tokens=1)
        # A first prompt of this length compiles the kernel variants its chunks launch (Triton's
        # first use of each shape class); the timed cold prefill is the second, on fresh tokens.
        llm.generate([[rng.randrange(10, vocab) for _ in range(depth)]], once)
        cold = self.timed(lambda: llm.generate([context], once))
        self.report(f"cold prefill {depth} tokens (TTFT {cold:.2f} s)", depth / cold, "tok/s",
                    depth * self.flops / self.prefill_flops(depth, 0), "tok/s matmul ceiling")
        pp_times = []
        for _ in range(3):
            prompt = context + [rng.randrange(10, vocab) for _ in range(self.pp)]
            pp_times.append(self.timed(lambda: llm.generate([prompt], once)))
        pp = statistics.median(pp_times)
        self.report(f"pp{self.pp} @ d{depth}", self.pp / pp, "tok/s",
                    self.pp * self.flops / self.prefill_flops(self.pp, depth), "tok/s matmul ceiling")
        rate = self.decode_rate(context, 16 if self.smoke else 64)
        runner = llm.engine.runner
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        embedding = runner.model.model.embed_tokens.weight
        active = weights - embedding.numel() * embedding.element_size() + embedding[0].nbytes
        kv = depth * bytes_per_block(runner.model.cache_specs()) / runner.block_size
        self.report(f"tg @ d{depth} bs=1 ({kv / 1e9:.1f} GB of KV)", rate, "tok/s", self.bandwidth / (active + kv),
                    "tok/s weight+KV roofline")

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """(t(N+1) - t(1)) / N over a cached prompt: prefill (a few uncached tokens) cancels out."""
        llm = self.llm()

        def run(n: int) -> float:
            return self.timed(lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))

        run(4), run(new_tokens + 1)  # warm-up: the graphs of this depth's bucket are captured here
        one = statistics.median(run(1) for _ in range(3))
        many = statistics.median(run(new_tokens + 1) for _ in range(3))
        return new_tokens / (many - one)

    # ---- a stream beside a long prefill -------------------------------------------------------

    def itl(self, part: str) -> None:
        self.drop_llm()
        overrides = {"prefill_attention_depth": 0} if part == "itl-tokens" else {}
        llm = LLM(self.config_dir, **self.engine_args(**overrides))
        engine = llm.engine
        depth = self.depths["d260k"]
        rng = random.Random(7)
        vocab = engine.hf_config.vocab_size
        engine.add_request("stream", [rng.randrange(10, vocab) for _ in range(128)],
                           SamplingParams(temperature=0, max_tokens=depth, ignore_eos=True))
        arrivals: list[float] = []
        long_added = long_done = None
        while True:
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id == "stream":
                    arrivals.extend([now] * len(out.outputs[0].token_ids))
                elif out.finished:
                    long_done = now
            if long_added is None and len(arrivals) >= 32:
                long_added = time.perf_counter()
                engine.add_request("long", [rng.randrange(10, vocab) for _ in range(depth)],
                                   SamplingParams(temperature=0, max_tokens=1))
            if long_done is not None:
                break
        engine.abort_request("stream")
        while engine.has_unfinished_requests():
            engine.step()
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if long_added <= a and b <= long_done]
        before = [b - a for a, b in zip(arrivals[:32], arrivals[1:32])]
        rule = "tokens only" if overrides else f"step cost, D = {engine.config.scheduler.prefill_attention_depth}"
        ms = sorted(g * 1e3 for g in gaps)
        self.report(f"{part}: {depth}-token prefill beside a stream ({rule})", long_done - long_added, "s TTFT")
        self.report(f"{part}: stream ITL p50 during it", statistics.median(ms), "ms")
        self.report(f"{part}: stream ITL p99 during it", ms[min(len(ms) - 1, int(0.99 * len(ms)))], "ms")
        self.report(f"{part}: stream ITL max during it", ms[-1], "ms")
        self.report(f"{part}: stream ITL p50 before it", 1e3 * statistics.median(before), "ms")
        del llm, engine
        self.drop_llm()

    # ---- start-up ---------------------------------------------------------------------------

    def startup(self) -> None:
        from startup_profile import time_to_first_token  # benchmarks/ is the script's directory

        self.drop_llm()
        flags = ["--model", self.config_dir, "--load-format", "dummy", "--kv-cache-dtype", "fp8",
                 "--max-model-len", "131072", "--kv-cache-bytes", "40G"]
        for mode in ("eager", "lazy"):
            health, first, log = time_to_first_token([*flags, "--cuda-graph-capture", mode])
            self.report(f"startup ({mode} graphs): to /health 200", health, "s")
            self.report(f"startup ({mode} graphs): to the first token", first, "s")
            for line in log:
                print(f"   {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="ceilings,d32k,d100k,d260k,itl,itl-tokens,startup",
                        help="comma-separated parts (see above)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random shape on the CPU (every part but startup)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    parts = [p for p in args.only.split(",") if p]
    known = {"ceilings", "itl", "itl-tokens", "startup", *DEPTHS}
    if unknown := sorted(set(parts) - known):
        parser.error(f"unknown parts {unknown}; choose from {sorted(known)}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY if args.smoke else LLAMA_31_8B_262K))
        bench = Bench(args.smoke, tmp)
        for part in parts:
            start = time.perf_counter()
            if part == "ceilings":
                bench.ceilings()
            elif part in DEPTHS:
                bench.depth_rows(part)
            elif part.startswith("itl"):
                bench.itl(part)
            elif part == "startup":
                if args.smoke:
                    print("startup: skipped with --smoke (benchmarks/startup_profile.py times the CPU default model)")
                else:
                    bench.startup()
            print(f"-- {part}: {time.perf_counter() - start:.1f} s", flush=True)
    print("\n| figure | value | ratio to the same-run ceiling |\n|---|---|---|")
    for name, value, ratio in bench.rows:
        print(f"| {name} | {value} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(bench.figures, indent=2))


if __name__ == "__main__":
    main()

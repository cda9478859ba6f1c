"""MTP speculation on one GPU: batch-1 decode of a Qwen3-Next-80B-A3B-shape model (FP8 block
weights, random: load_format=dummy) without speculation and with its MTP head drafting gamma
tokens under the BENCHMARK-ONLY fixed acceptance pattern (not lossless: drafts are accepted by a
pattern of mean acceptance length --acceptance-length, 3.5 by default, the rest rolled back as
real rejections are; random weights accept nothing of their own), in the same run; the ratio
(issue 24's target: >= 2.5x at 3.5, gamma 3); what one MTP step costs against one target step
(captured graphs, device time), and the device-only ceiling the captured steps allow; the same
with the head cut to a 32k-id draft vocabulary.

    python benchmarks/mtp_bench.py [--layers 48] [--gamma 3] [--acceptance-length 3.5] [--tokens 128]
                                   [--mtp-precision bf16|fp8] [--weights fp8|bf16] [--parts decode,vocab]
                                   [--json out.json]
    python benchmarks/mtp_bench.py --smoke   # tiny shapes on CPU, wall time: checks the script

The model: Qwen3-Next-80B-A3B's shape (hidden 2048, 48 layers: GDN 16 key / 32 value heads of
128, gated attention 16 / 2 KV heads of 256 every 4th layer, 512 experts of 512 top-10 + a gated
shared expert, vocab 151,936) and its one-layer MTP head (mtp_num_hidden_layers 1), weights FP8
with 128 x 128 block scales as Qwen's FP8 release stores them (lm_head, the routers and the shared
expert gates in bf16); the MTP head in bf16 (the users' layout) or FP8. --layers keeps the per-layer
shapes with fewer layers when 48 do not fit the time or memory at hand (say so in the report).
The MTP acceptance of a real checkpoint on the shipped corpus, full vocabulary against a draft
vocabulary, needs real weights: random ones accept nothing; tests/speculative/test_mtp_spec.py
prints both on its tiny checkpoints.
"""

from __future__ import annotations

import argparse
import gc
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
from hybrid_engine_bench import QWEN3_NEXT, TINY  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import BenchmarkOnlyConfig  # noqa: E402
from tokenmill.speculative.draft_vocab import save_draft_vocab  # noqa: E402

FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"]}
DRAFT_VOCAB = 32768


def decode_rate(llm: LLM, prompt_len: int, new_tokens: int, seed: int = 0) -> float:
    """bs=1 decode tok/s as (t(N + 1) - t(1)) / N (prefill excluded: one prompt, whose prefix-cache
    hit after the first run is the same in both)."""
    cuda = llm.engine.runner.device.type == "cuda"
    rng = random.Random(seed)
    prompt = [rng.randrange(2, llm.engine.hf_config.vocab_size) for _ in range(prompt_len)]

    def run(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(4), run(4)
    one = statistics.median(run(1) for _ in range(3))
    many = statistics.median(run(new_tokens + 1) for _ in range(3))
    return new_tokens / (many - one)


def free() -> None:
    """Return the memory of engines whose last reference the caller has dropped."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mtp_llm(path: Path, common: dict, gamma: int, length: float, vocab: Path | None) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": gamma, "draft_sampling": "greedy"}
    if vocab is not None:
        spec["draft_vocab"] = str(vocab)
    return LLM(str(path), **common, speculative_config=spec,
               benchmark_only=BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=length))


def step_costs(llm: LLM, gamma: int, length: float, report, label: str) -> None:
    """Captured-graph device time of the target's decode and verify steps and the head's steps
    (one row: a chained draft; 1 + gamma rows: following a verify step) at bs=1, 512 tokens."""
    from spec_bench import graph_step_ms

    runner, proposer = llm.engine.runner, llm.engine.proposer
    decode, verify = (graph_step_ms(g, 1, 512) for g in runner.graphs)
    chained, following = graph_step_ms(proposer.graphs[1], 1, 512), graph_step_ms(proposer.graphs[1 + gamma], 1, 512)
    report(f"  target decode step, bs=1 (graph){label}", decode, "ms")
    report(f"  target verify step ({1 + gamma} rows, graph){label}", verify, "ms", decode, "a decode step")
    report(f"  MTP chained-draft step (1 row, graph){label}", chained, "ms", decode, "a target step")
    report(f"  MTP following step ({1 + gamma} rows, graph){label}", following, "ms", decode, "a target step")
    cycle = following + (gamma - 1) * chained + verify  # a cycle: the following step drafts the first token
    report(f"  device-only ceiling at acceptance length {length}{label}", length * decode / cycle, "x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48, help="layers of the Qwen3-Next-80B shape (a multiple of 4)")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--acceptance-length", type=float, default=3.5, help="BENCHMARK-ONLY fixed pattern's mean")
    parser.add_argument("--tokens", type=int, default=128, help="decoded tokens per timed run")
    parser.add_argument("--mtp-precision", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--weights", choices=("fp8", "bf16"), default="fp8", help="bf16: no quantization (fewer --layers)")
    parser.add_argument("--parts", default="decode,vocab", help="decode: with and without MTP; vocab: a 32k draft vocabulary")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, wall time (checks the script)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    table = FigureTable(66)
    report = table.report
    device = "cpu" if args.smoke else "cuda"
    quant = dict(FP8_BLOCK)
    if args.mtp_precision == "bf16":
        quant["modules_to_not_convert"] = [*quant["modules_to_not_convert"], "mtp"]
    base = TINY if args.smoke else {**QWEN3_NEXT, "num_hidden_layers": args.layers}
    config = {**base, "mtp_num_hidden_layers": 1}
    if not args.smoke and args.weights == "fp8":
        config["quantization_config"] = quant
    common = dict(device=device, load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
                  max_model_len=2048 if args.smoke else 4096, max_num_seqs=1, max_num_batched_tokens=2048,
                  kv_cache_bytes=(1 << 25) if args.smoke else (4 << 30))
    tokens = 48 if args.smoke else args.tokens
    shape = "tiny Qwen3-Next" if args.smoke else f"Qwen3-Next-80B-A3B shape, {args.layers} layers, {args.weights} weights"
    print(f"{shape}; MTP head {args.mtp_precision if not args.smoke else 'fp32'}; gamma {args.gamma}; "
          f"BENCHMARK-ONLY fixed acceptance length {args.acceptance_length}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "config.json").write_text(json.dumps(config))
        plain = LLM(tmp, **common)
        rate = decode_rate(plain, 128, tokens)
        report("decode bs=1 @ 128, no speculation", rate, "tok/s")
        del plain
        free()
        runs: list[tuple[Path | None, str]] = [(None, "")] if "decode" in parts else []
        if "vocab" in parts:
            ids = random.Random(5).sample(range(config["vocab_size"]), min(DRAFT_VOCAB, config["vocab_size"] // 2))
            runs.append((save_draft_vocab(ids, path / "draft_vocab.txt"), f", {len(ids)}-id draft vocabulary"))
        for vocab, label in runs:
            llm = mtp_llm(path, common, args.gamma, args.acceptance_length, vocab)
            mtp_rate = decode_rate(llm, 128, tokens)
            report(f"decode bs=1 @ 128, MTP gamma {args.gamma}{label}", mtp_rate, "tok/s")
            report(f"  ratio to no speculation{label}", mtp_rate / rate, "x")
            report(f"  mean acceptance length (fixed pattern){label}", llm.engine.spec_stats.mean_acceptance_length, "")
            if not args.smoke:
                step_costs(llm, args.gamma, args.acceptance_length, report, label)
            del llm
            free()
    table.finish(args.json)


if __name__ == "__main__":
    main()

"""Speculative decoding on one GPU: what a verify step costs, and decode speed with drafts.

Target of Llama-3.1-8B shape, draft of Llama-3.2-1B shape, both random (load_format=dummy),
so a real draft's acceptance cannot be measured here; the figures are the machinery's:
  - the cost of a (1 + gamma)-token verify step against a 1-token step at batch 1/16/64, both
    as the engine runs them (captured CUDA graphs, device time), and of a step with fewer
    drafts run eagerly against the same step padded into the verify graph (wall time);
  - batch-1 decode tok/s without speculation; with the n-gram proposer on a repetitive prompt
    that the random target never continues (few drafts, all rejected: what the proposer costs
    where text does not repeat); with the n-gram proposer on the target's own looping output
    (ngram-own: drafts accepted by exact greedy verification, as the target makes them); and with
    the draft model under BENCHMARK-ONLY accept-all verification (not lossless: it shows the
    speed-up at full acceptance, acceptance length gamma + 1), with its full head and
    with the head cut to a 32k-token draft vocabulary; beside each, the ratio the captured
    steps allow with no host time at all (catch-up + (gamma - 1) draft steps + verify against
    gamma + 1, or 3.5, plain steps);
  - with --acceptance-length L, the accept-all parts accept by a fixed BENCHMARK-ONLY pattern
    of mean acceptance length L instead (e.g. 2, 3, 2, 3, ... drafts for 3.5; the rest rolled
    back as real rejections are), so the rate at a given acceptance length is measured, not
    only bounded;
  - cycle: one long request's steady state (the 32k-vocabulary draft, the first gamma of
    --vocab-gammas) timed by CUDA events around every graph replay: device time in each graph
    and between them per cycle, and the rate that steady state gives against no speculation;
  - prompt: what the draft's pass over a prompt costs (it runs behind the target's prefill): the
    draft's eager forward over 128 / 2048 tokens, FP8 weights read by the tensor-core kernel
    against the widened copies a CPU uses, and the time to first token with and without it.

    python benchmarks/spec_bench.py [--gamma 4] [--parts cost,ngram,ngram-own,accept,vocab,cycle,prompt]
                                    [--vocab-gammas 4,6] [--ngram-gammas 3,4,6] [--draft-quantization fp8]
                                    [--acceptance-length 3.5]
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import LLAMA_31_8B, decode_rate, median_time, random_prompt, replay_seconds  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import BenchmarkOnlyConfig  # noqa: E402
from tokenmill.runner.batch import Chunk, pack_context  # noqa: E402
from tokenmill.runner.cuda_graphs import StepGraphs  # noqa: E402
from tokenmill.runner.model_runner import ModelRunner  # noqa: E402
from tokenmill.speculative.stats import SpecStats  # noqa: E402

LLAMA_32_1B = {
    **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0},
}


def graph_step_ms(graphs: StepGraphs, batch: int, context: int, repeats: int = 20) -> float:
    """Median device time of one captured step: `batch` requests of `context` tokens each adding
    graphs.query_len tokens (the replayed graph is the one the engine would pick)."""
    q, size = graphs.query_len, graphs.block_size
    blocks = -(-context // size)
    positions = torch.arange(context - q, context)
    for b in range(batch):
        table = torch.arange(b * blocks, (b + 1) * blocks, dtype=torch.int32)
        graphs.block_tables[b, :blocks] = table
        graphs.seq_lens[b] = context
        graphs.positions[b * q : (b + 1) * q] = positions
        graphs.slot_mapping[b * q : (b + 1) * q] = table[positions // size].long() * size + positions % size
    bucket = graphs.buckets[bisect.bisect_left(graphs.buckets, batch)]
    graph = graphs.graphs[bucket, graphs.contexts[bisect.bisect_left(graphs.contexts, context)]]
    return 1e3 * replay_seconds(graph.replay, repeats)


def ragged_step_ms(runner: ModelRunner, verify: StepGraphs, rows: int, context: int, padded: bool) -> float:
    """Wall milliseconds (host launches included) of one bs=1 step adding `rows` tokens, every
    one sampled: eager, or padded into the verify graph as the runner does it."""
    table = list(range(-(-context // runner.block_size)))
    ids, ctx = pack_context([Chunk([0] * rows, context - rows, table)], runner.block_size, runner.device)
    model = runner.model

    def step() -> torch.Tensor:
        if padded:
            return verify.run_padded(ids, ctx)
        return model.compute_logits(model(ids, ctx))

    with torch.inference_mode():
        return 1e3 * median_time(step, repeats=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--vocab-gammas", default="",
                        help="comma-separated gammas for the draft-vocabulary part (default: --gamma)")
    parser.add_argument("--ngram-gammas", default="3,4,6", help="comma-separated gammas for the ngram-own part")
    parser.add_argument("--ngram-seeds", default="11,12,13", help="comma-separated seeds of the ngram-own part's prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft-quantization", choices=["fp8"], default=None,
                        help="quantize the draft's weights at load (the accept-all parts)")
    parser.add_argument("--acceptance-length", type=float, default=None,
                        help="the accept-all parts accept by a fixed pattern of this mean acceptance length instead "
                             "(benchmark-only), e.g. 3.5: the issue's target, measured")
    parser.add_argument("--parts", default="cost,ngram,ngram-own,accept,vocab,cycle,prompt",
                        help="verify-step cost, n-gram decode (drafts rejected / on the target's own loop), accept-all "
                             "decode, accept-all with a 32k draft vocabulary, the steady-state cycle, the draft's prompt pass")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    figures: dict[str, float] = {}

    def report(name: str, value: float, unit: str) -> None:
        figures[name] = value
        print(f"{name:<58} {value:>10,.2f} {unit}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = Path(tmp, "target"), Path(tmp, "draft")
        for path, config in ((target_dir, LLAMA_31_8B), (draft_dir, LLAMA_32_1B)):
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config))
        common = dict(load_format="dummy", dtype="bfloat16", max_model_len=8192, kv_cache_bytes=24 << 30, max_num_seqs=64)
        repetitive = list(range(1000, 1064)) * 8
        plain = LLM(str(target_dir), **common)
        base = decode_rate(plain, 128, args.tokens)
        report("bs=1 decode, no speculation (CUDA graphs)", base, "tok/s")
        base_rep = decode_rate(plain, len(repetitive), args.tokens, prompt=repetitive)
        report("bs=1 decode, no speculation, repetitive prompt", base_rep, "tok/s")
        del plain
        torch.cuda.empty_cache()

        if parts & {"cost", "ngram"}:
            ngram = LLM(str(target_dir), **common, speculative_config={"method": "ngram", "num_speculative_tokens": args.gamma})
            decode, verify = ngram.engine.runner.graphs
            for batch in (1, 16, 64) if "cost" in parts else ():
                one, many = graph_step_ms(decode, batch, 512), graph_step_ms(verify, batch, 512)
                report(f"verify step cost, bs={batch}, ctx 512: (1+{args.gamma}) / 1 token (graphs)", many / one, "x")
                report(f"  1-token step / verify step, bs={batch}", one, f"/ {many:.3f} ms")
            for rows in range(2, args.gamma + 1) if "cost" in parts else ():
                eager, padded = (ragged_step_ms(ngram.engine.runner, verify, rows, 512, p) for p in (False, True))
                report(f"step of {rows} sampled tokens, bs=1, ctx 512: eager / padded into the verify graph", eager / padded,
                       "x")
                report(f"  eager / padded (wall, host launches included), {rows} tokens", eager, f"/ {padded:.3f} ms")
            if "ngram" in parts:
                rate = decode_rate(ngram, len(repetitive), args.tokens, prompt=repetitive)
                report("bs=1 decode, n-gram, repetitive prompt (random weights)", rate, "tok/s")
                report("  ratio to no speculation on the same prompt", rate / base_rep, "x")
                report("  n-gram mean acceptance length", ngram.engine.spec_stats.mean_acceptance_length, "")
            del ngram, decode, verify
            torch.cuda.empty_cache()
        if "ngram-own" in parts:
            ngram_on_own_output(target_dir, common, [int(g) for g in args.ngram_gammas.split(",")], args.tokens, report,
                                [int(seed) for seed in args.ngram_seeds.split(",")])

        # The draft's head cut to a 32k-token draft vocabulary (the head is 21% of the 1B's
        # bytes): what `tokenmill draft-vocab build` buys.
        vocab_file = Path(tmp, "draft_vocab.npy")
        numpy.save(vocab_file, numpy.arange(32768, dtype=numpy.int64))
        if "accept" in parts:
            accept_all_decode(target_dir, draft_dir, common, args.gamma, args.tokens, base, report, None,
                              args.draft_quantization, args.acceptance_length)
        if "vocab" in parts:
            for gamma in [int(g) for g in args.vocab_gammas.split(",") if g] or [args.gamma]:
                accept_all_decode(target_dir, draft_dir, common, gamma, args.tokens, base, report, vocab_file,
                                  args.draft_quantization, args.acceptance_length)
        if parts & {"cycle", "prompt"}:
            gamma = int(args.vocab_gammas.split(",")[0]) if args.vocab_gammas else args.gamma
            llm = LLM(str(target_dir), **common, **draft_spec(
                draft_dir, gamma, vocab_file, args.draft_quantization, args.acceptance_length))
            if "cycle" in parts:
                steady_cycle(llm, base, report)
            if "prompt" in parts:
                prompt_pass(llm, target_dir, common, report)
    print(json.dumps(figures))


def ngram_on_own_output(target_dir: Path, common: dict, gammas: list[int], tokens: int,
                        report: Callable[[str, float, str], None], seeds: list[int],
                        embedding_scale: float = 65536.0) -> None:
    """The n-gram proposer where its drafts are accepted as the target makes them. The target's
    token embedding is scaled up (every projection keeps its random weights, so a step costs what
    it costs in any model; the embedding is only gathered) until what the layers add to the
    residual stream is tiny beside it (most of it rounds away in bf16): each next token is then,
    in effect, a function of the current one, and greedy output a walk that enters a loop once it
    meets a token again. The workload is a random prompt followed by the target's own 4,096
    greedy tokens; prompt lookup finds the loop and exact greedy verification accepts what the
    target would have produced anyway. Beside the rates, per seed of the random prompt: the
    loop's period, the mean acceptance length, and where speculation first changed the greedy
    output, with the gap between the target's two best log-probabilities there (the logits of a
    (1 + gamma)-row verify step and of a one-row step round differently in bf16, so near-ties can
    break either way)."""
    small = {**common, "kv_cache_bytes": 4 << 30}
    plain = LLM(str(target_dir), **small)
    engines = {g: LLM(str(target_dir), **small, speculative_config={"method": "ngram", "num_speculative_tokens": g})
               for g in gammas}
    with torch.no_grad():
        for llm in (plain, *engines.values()):
            llm.engine.runner.model.model.embed_tokens.weight.mul_(embedding_scale)
    checked = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    for seed in seeds:
        start = random_prompt(64, random.Random(seed))
        walk = plain.generate([start], SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
        prompt = start + walk[0].outputs[0].token_ids
        label = f"seed {seed}"
        report(f"own output ({label}, embedding x{embedding_scale:g}): loop period at its end (0: none)",
               tail_period(prompt[-2048:], 1536), "tokens")
        base = decode_rate(plain, len(prompt), tokens, prompt=prompt)
        report(f"  bs=1 decode, no speculation ({label}, {len(prompt)}-token prompt)", base, "tok/s")
        expected = plain.generate([prompt], checked)[0].outputs[0]
        for gamma, llm in engines.items():
            llm.engine.spec_stats = SpecStats()
            rate = decode_rate(llm, len(prompt), tokens, prompt=prompt)
            report(f"  n-gram, gamma {gamma}: bs=1 decode ({label})", rate, f"tok/s = {rate / base:.2f}x")
            report(f"    mean acceptance length / verify steps with drafts ({label}, gamma {gamma})",
                   llm.engine.spec_stats.mean_acceptance_length, f"/ {llm.engine.spec_stats.num_drafts}")
            got = llm.generate([prompt], checked)[0].outputs[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(expected.token_ids, got)) if a != b), None)
            gap = ""
            if first is not None:
                best, second = sorted(expected.logprobs[first].values(), reverse=True)[:2]
                gap = f"; log-prob gap of the target's two best there {best - second:.3f}"
            report(f"    greedy output: first token changed by speculation ({label}, gamma {gamma}; -1: none)",
                   -1 if first is None else first, f"of {tokens}{gap}")
    del plain, engines, llm
    gc.collect()
    torch.cuda.empty_cache()


def tail_period(ids: list[int], longest: int) -> int:
    """The shortest period p <= longest with ids[i] == ids[i + p] throughout, else 0."""
    return next((p for p in range(1, min(longest, len(ids) - 1) + 1) if ids[p:] == ids[:-p]), 0)


def draft_spec(draft_dir: Path, gamma: int, draft_vocab: Path | None, quantization: str | None,
               length: float | None) -> dict:
    """LLM options of the BENCHMARK-ONLY accept-all (or fixed acceptance length) configuration of
    the 1B-shape draft."""
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": gamma,
            "draft_sampling": "greedy"}
    if draft_vocab is not None:
        spec["draft_vocab"] = str(draft_vocab)
    if quantization:
        spec["quantization"] = quantization
    return {"speculative_config": spec,
            "benchmark_only": BenchmarkOnlyConfig(accept_all_drafts=True, acceptance_length=length)}


def accept_all_decode(target_dir: Path, draft_dir: Path, common: dict, gamma: int, tokens: int, base: float,
                      report: Callable[[str, float, str], None], draft_vocab: Path | None,
                      quantization: str | None, length: float | None = None) -> None:
    """BENCHMARK-ONLY accept-all decoding at bs=1 with the 1B-shape draft (optionally with a draft
    vocabulary and quantized weights; with `length`, drafts accepted by a fixed pattern of that
    mean acceptance length instead of all)."""
    label = f", gamma {gamma}" + ("" if draft_vocab is None else ", 32k draft vocabulary")
    label += f", {quantization} draft" if quantization else ""
    mode = "accept-all" if length is None else f"fixed acceptance length {length}"
    draft = LLM(str(target_dir), **common, **draft_spec(draft_dir, gamma, draft_vocab, quantization, length))
    rate = decode_rate(draft, 128, tokens)
    report(f"BENCHMARK-ONLY {mode}: bs=1 decode, 1B-shape draft{label}", rate, "tok/s")
    report(f"  ratio to no speculation{label}", rate / base, "x")
    report(f"  {mode}: mean acceptance length{label}", draft.engine.spec_stats.mean_acceptance_length, "")
    proposer = draft.engine.proposer
    one, verify = (graph_step_ms(g, 1, 512) for g in draft.engine.runner.graphs)
    draft_ms, catch_up_ms = graph_step_ms(proposer.decode_graphs, 1, 512), graph_step_ms(proposer.catch_up_graphs, 1, 512)
    report(f"  draft decode step, bs=1 (graph){label}", draft_ms, "ms")
    report(f"  draft catch-up step, bs=1 (graph){label}", catch_up_ms, "ms")
    # A cycle's device time with no host time at all: the catch-up drafts the first token,
    # gamma - 1 decode steps the rest, then the verify step; a plain step makes one token.
    cycle = catch_up_ms + (gamma - 1) * draft_ms + verify
    report(f"  device-only ceiling at full acceptance ({gamma + 1} tokens per {cycle:.2f} ms){label}",
           (gamma + 1) * one / cycle, "x")
    report(f"  device-only ceiling at acceptance length 3.5{label}", 3.5 * one / cycle, "x")
    del draft, proposer
    torch.cuda.empty_cache()


def steady_cycle(llm: LLM, base: float, report: Callable[[str, float, str], None], tokens: int = 514) -> None:
    """One long request timed by CUDA events around every graph replay, the first and last few
    cycles left out: device time per cycle inside each kind of graph and between graphs (the
    verify step's eager ops, the graphs' input copies, idle), and the steady rate against `base`."""
    graph_names = {id(g): sg.name for sg in (*llm.engine.runner.graphs, llm.engine.proposer.decode_graphs,
                                             llm.engine.proposer.catch_up_graphs) for g in sg.graphs.values()}
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        marks.append((graph_names.get(id(graph), "other"), start, end))

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([list(range(1000, 1128))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    torch.cuda.CUDAGraph.replay = timed
    try:
        llm.generate([list(range(2000, 2128))], params)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    torch.cuda.synchronize()
    verifies = [i for i, (name, _, _) in enumerate(marks) if name == "verify"]
    steady = marks[verifies[4] + 1 : verifies[-4] + 1]  # whole cycles, each ending with its verify step
    cycles = len(verifies) - 8
    inside: dict[str, float] = {}
    for name, start, end in steady:
        inside[name] = inside.get(name, 0.0) + start.elapsed_time(end) / cycles
    span = steady[0][1].elapsed_time(steady[-1][2]) / cycles
    length = llm.engine.spec_stats.mean_acceptance_length
    for name, ms in sorted(inside.items()):
        report(f"  steady cycle: device ms inside {name} graphs", ms, "ms")
    report("  steady cycle: device ms between graphs (eager ops, input copies, idle)", span - sum(inside.values()), "ms")
    report(f"steady cycle ({cycles} cycles, acceptance length {length:.2f}): ms per cycle", span, "ms")
    report("  steady-state rate", 1e3 * length / span, "tok/s")
    report("  steady-state ratio to no speculation", 1e3 * length / span / base, "x")


def prompt_pass(llm: LLM, target_dir: Path, common: dict, report: Callable[[str, float, str], None]) -> None:
    """The draft's eager forward over a prompt (FP8 weights through the tensor-core kernel, and
    through the widened copies a CPU uses): the host's launch time and the wall time; and the
    time to first token with the draft following the prefill against the target alone."""
    from tokenmill.layers.linear import Linear
    from tokenmill.quantization import Fp8RowLinearMethod

    proposer = llm.engine.proposer
    draft, size = proposer.draft.model, proposer.draft.block_size
    linears = [m for m in draft.modules() if isinstance(m, Linear) and isinstance(m.method, Fp8RowLinearMethod)]
    plain = LLM(str(target_dir), **common)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(5)
    gc.disable()  # a collection of the engines' object graphs inside a timed call moves it by milliseconds
    try:
        for tokens in (128, 2048):
            # Free blocks' draft KV is scratch here: nothing runs, and a prefix hit recomputes the draft's part.
            chunk = Chunk(list(range(tokens)), 0, list(range(-(-tokens // size))))
            ids, ctx = pack_context([chunk], size, proposer.draft.device)
            for kernel in (True, False):
                for m in linears:
                    m.method.use_triton = kernel
                with torch.inference_mode():
                    host, wall = launch_and_wall_ms(lambda: draft(ids, ctx))
                report(f"draft prompt pass, {tokens} tokens, {'FP8 kernel' if kernel else 'widened copies'}: host / wall",
                       host, f"/ {wall:.2f} ms")
            for m in linears:
                m.method.use_triton = True
            ttft = [1e3 * median_time(lambda e=e: e.generate([random_prompt(tokens, rng)], params), repeats=9)
                    for e in (llm, plain)]
            report(f"  time to first token, {tokens}-token prompt: with the draft / target alone", ttft[0],
                   f"/ {ttft[1]:.2f} ms")
    finally:
        gc.enable()


def launch_and_wall_ms(fn: Callable[[], object], repeats: int = 9) -> tuple[float, float]:
    """Median milliseconds until fn returns on the host (its launches) and until the device is done."""
    fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(wall)


if __name__ == "__main__":
    main()

"""Soak: rounds of one long request (260k tokens by default) beside short ones, for N minutes,
against tokenmill in this process (Llama-3.1-8B shape, random weights, FP8 KV) or a running server.

Each round submits the long request and `--shorts` short ones together and waits for all; then
checks that every KV block is back (prefix-cached blocks sit in the free pool: used blocks must
be 0) and records the round's peak GPU memory. Reports errors, out-of-memory errors, rounds that
ended with blocks still in use, and peak memory round by round (steady memory: the last rounds'
peak no higher than the first's).

    python benchmarks/long_context_soak.py --minutes 3                    # in-process, one H200
    python benchmarks/long_context_soak.py --url http://127.0.0.1:8000 --minutes 10
    python benchmarks/long_context_soak.py --smoke --minutes 0.2          # tiny shape on the CPU

Exit status 1 when any round had an error, an OOM or a leak.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from long_context_bench import LLAMA_31_8B_262K, TINY  # benchmarks/ is the script's directory


@dataclass
class Totals:
    rounds: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    ooms: int = 0
    leaks: list[str] = field(default_factory=list)
    peaks_gb: list[float] = field(default_factory=list)
    long_seconds: list[float] = field(default_factory=list)


def prompts(rng: random.Random, vocab: int, long_len: int, short_len: int, shorts: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in [long_len] + [short_len] * shorts]


class InProcess:
    """tokenmill.LLM in this process: its engine stepped directly, its block pool read directly."""

    def __init__(self, smoke: bool, long_len: int, config_dir: str) -> None:
        import torch

        from tokenmill import LLM

        self.torch = torch
        self.cuda = not smoke and torch.cuda.is_available()
        if smoke:
            args = dict(device="cpu", dtype="float32", max_model_len=long_len + 256, kv_cache_bytes=256 << 20,
                        max_num_batched_tokens=256)
        else:
            args = dict(dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=262144, kv_cache_bytes=40 << 30,
                        max_num_seqs=16, cuda_graph_capture="lazy")
        self.llm = LLM(config_dir, load_format="dummy", **args)
        self.vocab = self.llm.engine.hf_config.vocab_size

    def round(self, batch: list[list[int]], long_tokens: int, short_tokens: int, totals: Totals, index: int) -> None:
        from tokenmill import SamplingParams

        engine = self.llm.engine
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        ids = [f"r{index}-{i}" for i in range(len(batch))]
        start = time.perf_counter()
        try:
            for request_id, prompt, n in zip(ids, batch, [long_tokens] + [short_tokens] * (len(batch) - 1)):
                engine.add_request(request_id, prompt, SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id == ids[0]:
                        totals.long_seconds.append(time.perf_counter() - start)
        except Exception as error:  # an OOM or any failure: counted, its requests aborted, the soak goes on
            if isinstance(error, self.torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
                totals.ooms += 1
            totals.errors.append(f"round {index}: {type(error).__name__}: {error}"[:500])
            engine.abort_failed_step()
            for request_id in ids:
                engine.abort_request(request_id)
        totals.requests += len(batch)
        stats = engine.stats()
        if stats.kv_blocks_used or stats.num_running or stats.num_waiting:
            totals.leaks.append(f"round {index}: {stats.kv_blocks_used} blocks used, {stats.num_running} running, "
                                f"{stats.num_waiting} waiting after every request ended")
        if self.cuda:
            totals.peaks_gb.append(self.torch.cuda.max_memory_allocated() / 1e9)


class Server:
    """A running OpenAI-compatible tokenmill server: /v1/completions with token ids, /metrics for blocks."""

    def __init__(self, url: str, vocab: int) -> None:
        self.url = url.rstrip("/")
        self.vocab = vocab
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as response:
            self.model = json.load(response)["data"][0]["id"]

    def complete(self, prompt: list[int], max_tokens: int) -> float:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                           "temperature": 0.7}).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as response:
            response.read()
        return time.perf_counter() - start

    def blocks_used(self) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        found = re.search(r"^tokenmill:kv_cache_blocks_used\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else float("nan")

    def round(self, batch: list[list[int]], long_tokens: int, short_tokens: int, totals: Totals, index: int) -> None:
        limits = [long_tokens] + [short_tokens] * (len(batch) - 1)
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            futures = [pool.submit(self.complete, prompt, n) for prompt, n in zip(batch, limits)]
            for i, future in enumerate(futures):
                try:
                    seconds = future.result()
                    if i == 0:
                        totals.long_seconds.append(seconds)
                except urllib.error.HTTPError as error:
                    detail = error.read().decode(errors="replace")[:300]
                    totals.ooms += "out of memory" in detail.lower()
                    totals.errors.append(f"round {index} request {i}: HTTP {error.code}: {detail}")
                except Exception as error:
                    totals.errors.append(f"round {index} request {i}: {type(error).__name__}: {error}"[:500])
        totals.requests += len(batch)
        for _ in range(50):  # the engine frees a request's blocks right after its last token is sent
            used = self.blocks_used()
            if used == 0:
                break
            time.sleep(0.1)
        else:
            totals.leaks.append(f"round {index}: {used:g} blocks used after every request ended")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="soak for this long (rounds started before it ends finish)")
    parser.add_argument("--url", default=None, help="a running server (default: tokenmill in this process)")
    parser.add_argument("--long", type=int, default=260_000, help="tokens of each round's long prompt")
    parser.add_argument("--long-answer", type=int, default=16, help="tokens the long request generates")
    parser.add_argument("--shorts", type=int, default=4, help="short requests beside each long one")
    parser.add_argument("--short", type=int, default=512, help="tokens of each short prompt")
    parser.add_argument("--short-answer", type=int, default=256, help="tokens each short request generates")
    parser.add_argument("--vocab", type=int, default=128256, help="server mode: token ids are drawn below this")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, 2k-token long prompts")
    parser.add_argument("--json", type=Path, default=None, help="write the totals here too")
    args = parser.parse_args()
    if args.smoke:
        args.long, args.short, args.short_answer = min(args.long, 2048), min(args.short, 64), min(args.short_answer, 32)
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            target: Any = Server(args.url, args.vocab)
        else:
            (Path(tmp) / "config.json").write_text(json.dumps(TINY if args.smoke else LLAMA_31_8B_262K))
            target = InProcess(args.smoke, args.long, tmp)
        rng = random.Random(0)
        totals = Totals()
        deadline = time.perf_counter() + 60 * args.minutes
        while time.perf_counter() < deadline:
            batch = prompts(rng, target.vocab, args.long, args.short, args.shorts)
            target.round(batch, args.long_answer, args.short_answer, totals, totals.rounds)
            totals.rounds += 1
            peak = f", peak {totals.peaks_gb[-1]:.2f} GB" if totals.peaks_gb else ""
            print(f"round {totals.rounds}: {len(totals.errors)} errors, {totals.ooms} OOM, {len(totals.leaks)} leaks{peak}",
                  flush=True)
    peaks = totals.peaks_gb
    steady = not peaks or max(peaks[len(peaks) // 2:]) <= max(peaks[: max(1, len(peaks) // 2)]) + 0.05
    summary = {
        "minutes": args.minutes, "rounds": totals.rounds, "requests": totals.requests, "errors": len(totals.errors),
        "ooms": totals.ooms, "leaks": len(totals.leaks), "peak_gb_first": peaks[0] if peaks else None,
        "peak_gb_max": max(peaks) if peaks else None, "steady_memory": steady,
        "long_request_seconds_median": statistics.median(totals.long_seconds) if totals.long_seconds else None,
        "error_lines": totals.errors[:20], "leak_lines": totals.leaks[:20],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if totals.errors or totals.ooms or totals.leaks or not steady else 0


if __name__ == "__main__":
    sys.exit(main())

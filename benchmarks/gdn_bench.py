"""Gated-delta-rule and causal-conv1d kernels on one GPU, beside the copy rate measured in the same run.

    python benchmarks/gdn_bench.py [--no-sweep] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/gdn_bench.py --smoke   # tiny, on CPU: checks the script

Shapes: Qwen3-Next-80B-A3B's GDN layer (16 key / 32 value heads of 128, conv width 8192, kernel 4),
Kimi-Linear's KDA (32 / 32 of 128, per-channel gate), bf16 activations. First every kernel is
checked against its PyTorch reference at these shapes. Then:
- decode (one token per request over a shuffled slot pool) at batch 1/32/64/256 with float32 and
  bfloat16 state: GB/s counts the state bytes read and written, its ratio is to the
  device-to-device copy rate (read + written) measured here (target >= 80% at batch 32+);
  verification (1 + 4 tokens, a checkpoint per position) at batch 32;
- chunked prefill of one fresh request of 2k/8k/32k tokens: tokens/s (GDN; KDA at 8k);
- conv1d decode (window bytes read + written) and prefill;
- if fla (fla-core) is importable: its fused_recurrent / chunk_gated_delta_rule on the same
  inputs (no slot pool: a contiguous state per request, the same bytes);
- the sweep times other value-column tiles and warps of the decode kernel, and of the chunked
  kernels at the middle prefill length.
Decode and conv times are CUDA-graph replays after an L2 flush (the engine captures decode);
prefill runs eagerly as in the engine (its chunk plan is made on the host). Medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from an uninstalled checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_bench import print_table, record, rows, timer  # noqa: E402  (the shared timing and table)
from gpu_bench import copy_seconds, median_time  # noqa: E402

from tokenmill.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref  # noqa: E402
from tokenmill.kernels.gated_delta import (  # noqa: E402
    gated_delta_rule,
    gated_delta_rule_chunked_ref,
    gated_delta_rule_ref,
)
from tokenmill.kernels.gated_delta_chunk import chunk_gated_delta_rule  # noqa: E402
from tokenmill.kernels.gated_delta_recurrent import recurrent_gated_delta_rule  # noqa: E402


@dataclass(frozen=True)
class Setup:
    device: str
    key_heads: int
    value_heads: int
    head_dim: int
    conv_width: int  # channels of the short convolution
    batches: tuple[int, ...]
    prefills: tuple[int, ...]
    verify_batch: int
    repeats: int


FULL = Setup("cuda", 16, 32, 128, 2 * 16 * 128 + 32 * 128, (1, 32, 64, 256), (2048, 8192, 32768), 32, 20)
SMOKE = Setup("cpu", 2, 4, 16, 48, (1, 3), (24, 70), 2, 1)
STATE_DTYPES = ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
GAMMA = 4


def eager_time(s: Setup, fn: Callable[[], object]) -> float:
    """Median seconds of fn run eagerly (host work included), after a warm-up call."""
    if s.device == "cuda":
        return median_time(fn, max(3, s.repeats // 4))
    fn()
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


class Bench:
    def __init__(self, s: Setup) -> None:
        self.s = s
        self.time = timer(s)
        self.copy_gbs = 1.0
        self.gen = torch.Generator(device=s.device).manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.s.device).to(dtype)

    def inputs(self, lengths: list[int], state_dtype: torch.dtype, per_channel: bool = False, spare: int = 0):
        """Packed q, k, v, g, beta, a shuffled pool (a spare slot per request, or `spare`),
        slots, cu_seqlens, has_initial_state (True but for prefill), scale."""
        s = self.s
        heads = s.key_heads * 2 if per_channel else s.value_heads  # Kimi-Linear: 32 / 32
        key_heads = heads if per_channel else s.key_heads
        total, num = sum(lengths), len(lengths)
        gate_shape = (total, heads, s.head_dim) if per_channel else (total, heads)
        g = -torch.nn.functional.softplus(self.randn(*gate_shape, dtype=torch.float32)) * 0.3
        pool = self.randn(num + (spare or num), heads, s.head_dim, s.head_dim, dtype=state_dtype)
        slots = torch.randperm(pool.shape[0], device=s.device)[:num].to(torch.int32)
        cu = torch.tensor([0] + lengths, device=s.device).cumsum(0).to(torch.int32)
        fresh = torch.tensor([n <= 1 + GAMMA for n in lengths], device=s.device)
        return (self.randn(total, key_heads, s.head_dim), self.randn(total, key_heads, s.head_dim),
                self.randn(total, heads, s.head_dim), g, torch.rand(total, heads, generator=self.gen, device=s.device).to(
                    torch.bfloat16), pool, slots, cu, fresh), s.head_dim**-0.5

    def ceiling(self) -> None:
        src = torch.empty(1 << 30 if self.s.device == "cuda" else 1 << 20, dtype=torch.uint8, device=self.s.device)
        dst = torch.empty_like(src)
        self.copy_gbs = record("ceiling", "copy (read + write)", copy_seconds(self.time, dst, src), 2 * src.numel())["GB/s"]

    def check(self) -> None:
        """Each path against its reference at these head sizes (fails loudly: numbers from a
        wrong kernel mean nothing)."""
        s = self.s
        cases = [("decode", [1] * 4, False, torch.float32), ("verify 1+4", [1 + GAMMA] * 3, False, torch.bfloat16),
                 ("prefill", [s.prefills[0], 3], False, torch.float32), ("kda prefill", [s.prefills[0] // 2], True,
                                                                          torch.float32)]
        for name, lengths, per_channel, state_dtype in cases:
            args, scale = self.inputs(lengths, state_dtype, per_channel)
            pool = args[5].clone()
            ref = gated_delta_rule_ref if max(lengths) <= 1 + GAMMA else gated_delta_rule_chunked_ref
            want = ref(*args[:5], pool, *args[6:], scale=scale)
            got = gated_delta_rule(*args, scale=scale)
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            state_error = ((args[5].float() - pool.float()).abs().max() / pool.float().abs().max()).item()
            print(f"check gdn {name}: max error {error:.1e} of max |o|, state {state_error:.1e}", flush=True)
            assert error < 3e-2 and state_error < 3e-2, f"gdn {name} disagrees with its reference"
        for lengths in ([1] * 4, [s.prefills[0], 2]):
            x = self.randn(sum(lengths), s.conv_width)
            weight, window = self.randn(s.conv_width, 4), self.randn(2 * len(lengths), 3, s.conv_width)
            meta = (torch.arange(len(lengths), device=s.device, dtype=torch.int32),
                    torch.tensor([0] + lengths, device=s.device).cumsum(0).to(torch.int32),
                    torch.ones(len(lengths), dtype=torch.bool, device=s.device))
            want_window = window.clone()
            want = causal_conv1d_ref(x, weight, None, want_window, *meta)
            torch.testing.assert_close(causal_conv1d(x, weight, None, window, *meta), want, atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(window, want_window, atol=3e-2, rtol=3e-2)
        print("check conv1d: decode and prefill agree", flush=True)

    def state_bytes(self, requests: int, state_dtype: torch.dtype) -> int:
        s = self.s
        return 2 * requests * s.value_heads * s.head_dim**2 * state_dtype.itemsize  # read + written

    def decode(self) -> None:
        for state_dtype, tag in STATE_DTYPES:
            for batch in self.s.batches:
                args, scale = self.inputs([1] * batch, state_dtype)
                seconds = self.time(lambda: gated_delta_rule(*args, scale=scale))
                row = record("gdn decode", f"batch {batch} state={tag}", seconds, self.state_bytes(batch, state_dtype))
                row["ratio"] = row["GB/s"] / self.copy_gbs
            batch = self.s.verify_batch
            args, scale = self.inputs([1 + GAMMA] * batch, state_dtype, spare=batch * (1 + GAMMA))
            free = torch.ones(args[5].shape[0], dtype=torch.bool, device=self.s.device)
            free[args[6].long()] = False
            marks = torch.nonzero(free).flatten().to(torch.int32)  # a checkpoint slot per position
            nbytes = self.state_bytes(batch, state_dtype) * (3 + GAMMA) // 2  # read, final write, 1 + gamma checkpoints
            seconds = self.time(lambda: gated_delta_rule(*args, scale=scale, checkpoint_slots=marks))
            record("gdn verify", f"batch {batch} 1+{GAMMA}, checkpoints, state={tag}", seconds, nbytes)
        batch = self.s.batches[1]
        args, scale = self.inputs([1] * batch, torch.float32, per_channel=True)
        seconds = self.time(lambda: gated_delta_rule(*args, scale=scale))
        row = record("kda decode", f"batch {batch} state=fp32", seconds, self.state_bytes(batch, torch.float32))
        row["ratio"] = row["GB/s"] / self.copy_gbs

    def prefill(self) -> None:
        s = self.s
        for tokens in s.prefills:
            args, scale = self.inputs([tokens], torch.float32)
            seconds = eager_time(s, lambda: gated_delta_rule(*args, scale=scale))
            record("gdn prefill", f"{tokens} tokens", seconds, tok_per_s=tokens / seconds)
        tokens = s.prefills[len(s.prefills) // 2]
        args, scale = self.inputs([tokens], torch.float32, per_channel=True)
        seconds = eager_time(s, lambda: gated_delta_rule(*args, scale=scale))
        record("kda prefill", f"{tokens} tokens", seconds, tok_per_s=tokens / seconds)

    def conv(self) -> None:
        s = self.s
        for batch in s.batches:
            x, weight = self.randn(batch, s.conv_width), self.randn(s.conv_width, 4)
            window = self.randn(2 * batch, 3, s.conv_width)
            meta = (torch.randperm(2 * batch, device=s.device)[:batch].to(torch.int32),
                    torch.arange(batch + 1, device=s.device, dtype=torch.int32), torch.ones(batch, dtype=torch.bool,
                                                                                           device=s.device))
            seconds = self.time(lambda: causal_conv1d(x, weight, None, window, *meta))
            record("conv1d decode", f"batch {batch}", seconds, 2 * window[:batch].numel() * 2)
        tokens = s.prefills[-1]
        x, weight, window = self.randn(tokens, s.conv_width), self.randn(s.conv_width, 4), self.randn(2, 3, s.conv_width)
        meta = (torch.zeros(1, device=s.device, dtype=torch.int32), torch.tensor([0, tokens], device=s.device,
                                                                                  dtype=torch.int32),
                torch.zeros(1, dtype=torch.bool, device=s.device))
        seconds = self.time(lambda: causal_conv1d(x, weight, None, window, *meta))
        record("conv1d prefill", f"{tokens} tokens", seconds, 2 * x.numel() * 2, tok_per_s=tokens / seconds)

    def fla(self) -> None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError:
            print("fla is not importable: no peer rows", flush=True)
            return
        s = self.s
        for batch in s.batches:
            args, scale = self.inputs([1] * batch, torch.float32)
            q, k, v, g, beta, pool, slots, cu, _ = args
            q, k = (x.repeat_interleave(s.value_heads // s.key_heads, dim=1) for x in (q, k))  # fla's heads as v's
            initial = pool[slots.long()].contiguous()

            def run(q=q, k=k, v=v, g=g, beta=beta, initial=initial, cu=cu) -> object:
                return fused_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                                        initial_state=initial, output_final_state=True, cu_seqlens=cu,
                                                        use_qk_l2norm_in_kernel=True)
            self.peer("fla decode", f"batch {batch} state=fp32", run, nbytes=self.state_bytes(batch, torch.float32))
        for tokens in s.prefills:
            (q, k, v, g, beta, pool, slots, cu, _), scale = self.inputs([tokens], torch.float32)
            q, k = (x.repeat_interleave(s.value_heads // s.key_heads, dim=1) for x in (q, k))

            def run(q=q, k=k, v=v, g=g, beta=beta, cu=cu) -> object:
                return chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                                              output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            self.peer("fla prefill", f"{tokens} tokens", run, tokens=tokens)

    def peer(self, group: str, name: str, run: Callable[[], object], nbytes: int = 0, tokens: int = 0) -> None:
        try:
            seconds = eager_time(self.s, run) if tokens else self.time(run)
        except Exception as exc:  # a peer's limits are a row, not the end of the run
            print(f"{group} {name}: fla failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        row = record(group, name, seconds, nbytes, **({"tok_per_s": tokens / seconds} if tokens else {}))
        if nbytes:
            row["ratio"] = row["GB/s"] / self.copy_gbs

    def sweep(self) -> None:
        for state_dtype, tag in STATE_DTYPES:
            for batch in (1, 32, 256) if self.s.device == "cuda" else self.s.batches[:1]:
                args, scale = self.inputs([1] * batch, state_dtype)
                smoke = self.s.device != "cuda"
                for block_v in (8, 16) if smoke else (16, 32, 64, 128):
                    for warps in (1,) if smoke else (2, 4, 8):
                        seconds = self.time(lambda: recurrent_gated_delta_rule(*args, scale=scale, block_v=block_v,
                                                                               num_warps=warps))
                        row = record("sweep decode", f"batch {batch} state={tag}", seconds,
                                     self.state_bytes(batch, state_dtype), plan=f"v{block_v} w{warps}")
                        row["ratio"] = row["GB/s"] / self.copy_gbs


    def sweep_prefill(self) -> None:
        s = self.s
        tokens = s.prefills[len(s.prefills) // 2]
        for per_channel in (False, True):
            args, scale = self.inputs([tokens], torch.float32, per_channel=per_channel)
            for prepare_warps in (8, 16) if s.device == "cuda" else (1,):
                for block_v, warps in ((32, 4), (32, 8), (64, 8)) if s.device == "cuda" else ((8, 1),):
                    seconds = eager_time(s, lambda: chunk_gated_delta_rule(
                        *args, scale=scale, block_v=block_v, num_warps=warps, prepare_warps=prepare_warps))
                    record("sweep prefill", f"{'kda' if per_channel else 'gdn'} {tokens} tokens", seconds,
                           tok_per_s=tokens / seconds, plan=f"prepare w{prepare_warps}, scan v{block_v} w{warps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode tile sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run with TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    began = time.perf_counter()
    s = SMOKE if args.smoke else FULL
    if s.device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bench = Bench(s)
    bench.ceiling()
    bench.check()
    for stage in (bench.decode, bench.prefill, bench.conv, bench.fla):
        stage()
    if not args.no_sweep:
        bench.sweep()
        bench.sweep_prefill()
    for row in rows:
        if "tok_per_s" in row:
            row["plan"] = f"{row['tok_per_s']:,.0f} tok/s" + (f", {row['plan']}" if "plan" in row else "")
    print(f"copy {bench.copy_gbs:.0f} GB/s, {time.perf_counter() - began:.0f} s")
    print_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": bench.copy_gbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

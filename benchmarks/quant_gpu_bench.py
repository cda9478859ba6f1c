"""Quantized checkpoint formats on one GPU, each figure beside its ceiling measured in the same run.

    python benchmarks/quant_gpu_bench.py [--only linears,decode,prefill,moe,nvfp4-linears,nvfp4-decode,nvfp4-moe,
                                                 dual-prefill] [--json out.json]
    python benchmarks/quant_gpu_bench.py --smoke    # tiny shapes on the CPU (Triton's interpreter): checks the script

The NVFP4 parts (nvfp4-linears, nvfp4-decode, nvfp4-moe, dual-prefill) are described in
benchmarks/nvfp4_parts.py.

Ceilings: device copy bandwidth (bytes read + written), the FP8 matmul rate (torch._scaled_mm with
row-wise scales at 2048 x 4096 x 4096 and 2048 x 14336 x 4096) and the bf16 matmul rate.

- linears: Llama-3.1-8B's projections (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
  4096x14336, lm_head 128256x4096) in each format (FP8 per channel, 128x128 block FP8, MXFP8)
  through the layer's kernels: at M = 1 (a CUDA graph of the call; roofline = weight + scale
  bytes / copy bandwidth) and at M = 2048 (FLOPs / time against the FP8 matmul rate; MXFP8,
  weight-only on Hopper, against the bf16 rate). Each first checked against its reference.
- decode: the whole engine, Llama-3.1-8B shape with random FP8 weights (per channel, block;
  head kept bf16), batch-1 decode after a 128-token prompt as (t(N+1) - t(1)) / N against the
  roofline of the bytes a token reads (every parameter but the embedding table, and one
  embedding row; the KV of a 128-token context is under 0.2 % and left out). Target >= 90 %.
- prefill: one cold 2048-token prefill of the same models against the FP8 matmul rate on the
  linear FLOPs (2 * params * tokens) plus causal attention. Target >= 70 %.
- moe: Qwen3-30B-A3B's routed experts (E = 128, k = 8, H = 2048, I = 768) with FP8 block and
  MXFP8 weights: T = 1 against the bytes of the 8 selected experts, T = 2048 against the bf16 rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tokenmill.numerics import FP8_E4M3, e8m0_exponent, scale_grid_shape  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (96, 128), "down": (64, 256)}
FORMATS = {"fp8-channel": ((1, 0), "w8a8-rows"), "fp8-block": ((128, 128), "w8a8-blocks"), "mxfp8": ((1, 32), "w8a16")}
CONFIGS = {"fp8-channel": {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "ignore": ["lm_head"]},
           "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}}


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median seconds of one call: a CUDA graph's replay on the GPU, wall time on the CPU (smoke)."""
    if device.type != "cuda":
        import time

        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    from gpu_bench import graph_time

    return graph_time(fn, repeats)


def scaled_weight(n: int, k: int, block: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.randn(n, k, device=device) * 32).clamp(-448, 448).to(FP8_E4M3)
    grid = scale_grid_shape(n, k, block)
    if block[1] == 32:
        return weight, e8m0_exponent(torch.full(grid, 0.02 * 14, device=device))
    return weight, torch.full(grid, 0.02 / 32, device=device)


def ceilings(device: torch.device, smoke: bool) -> dict[str, float]:
    if smoke:
        return {"copy_bytes_per_s": 1e9, "fp8_flops": 1e9, "bf16_flops": 1e9}
    from gpu_bench import copy_bandwidth, matmul_flops, median_time

    rates = []
    for n, k in ((4096, 4096), (14336, 4096)):
        a = torch.randn(2048, k, device=device).to(FP8_E4M3)
        b = torch.randn(n, k, device=device).to(FP8_E4M3)
        sa, sb = torch.ones(2048, 1, device=device), torch.ones(1, n, device=device)
        seconds = median_time(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 10)
        rates.append(2 * 2048 * n * k / seconds)
    return {"copy_bytes_per_s": copy_bandwidth(), "fp8_flops": max(rates), "bf16_flops": matmul_flops()}


def linears(device: torch.device, ceiling: dict[str, float], smoke: bool) -> list[dict]:
    from tokenmill.kernels.fp8_gemm import scaled_fp8_linear, w8a8_ref
    from tokenmill.kernels.gemv import gemv_ref

    rows_out = []
    for fmt, (block, prefill) in FORMATS.items():
        for name, (n, k) in (SMOKE_SHAPES if smoke else SHAPES).items():
            weight, scale = scaled_weight(n, k, block, device)
            scales_1d = scale.view(-1) if block[1] == 0 else scale
            for m in (1, 24 if smoke else 2048):
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                got = scaled_fp8_linear(x, weight, scale, block, None, prefill).float()
                if m > 16 and prefill != "w8a16" and not smoke:
                    ref = w8a8_ref(x, weight, scale, block)
                else:
                    ref = gemv_ref(x, weight, None, scales_1d, None if block[1] == 0 else block)
                error = ((got - ref).abs().max() / ref.abs().max()).item()
                seconds = timed(lambda: scaled_fp8_linear(x, weight, scale, block, None, prefill), device)
                if m == 1:
                    nbytes = weight.numel() + scale.numel() * scale.element_size()
                    value, ceiling_value, unit = nbytes / seconds, ceiling["copy_bytes_per_s"], "GB/s read"
                else:
                    value, unit = 2 * m * n * k / seconds, "TFLOP/s"
                    ceiling_value = ceiling["bf16_flops" if prefill == "w8a16" else "fp8_flops"]
                rows_out.append({"part": "linears", "what": f"{fmt} {name} {n}x{k} M={m}", "value": value, "unit": unit,
                                 "ceiling": ceiling_value, "ratio": value / ceiling_value, "rel_error": error})
    return rows_out


def llama_dir(fmt: str, smoke: bool) -> str:
    from gpu_bench import LLAMA_31_8B

    config = dict(LLAMA_31_8B, quantization_config=CONFIGS[fmt])
    if smoke:
        config.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)
    directory = tempfile.mkdtemp(prefix=f"quant_bench_{fmt}_")
    Path(directory, "config.json").write_text(json.dumps(config))
    return directory


def engine(device: torch.device, ceiling: dict[str, float], smoke: bool, parts: set[str]) -> list[dict]:
    from tokenmill import LLM

    rows_out = []
    for fmt in CONFIGS:
        llm = LLM(llama_dir(fmt, smoke), load_format="dummy", max_model_len=4096, device=device.type, max_num_seqs=4,
                  kv_cache_bytes=(1 << 24) if smoke else 8 << 30, enforce_eager=smoke)
        model = llm.engine.runner.model
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight
        token_bytes = params - embed.numel() * embed.element_size() + embed[0].numel() * embed.element_size()
        if "decode" in parts:
            rate = _decode_rate(llm, smoke)
            roofline = ceiling["copy_bytes_per_s"] / token_bytes
            rows_out.append({"part": "decode", "what": f"{fmt} batch 1 after 128", "value": rate, "unit": "tok/s",
                             "ceiling": roofline, "ratio": rate / roofline})
        if "prefill" in parts:
            tokens = 64 if smoke else 2048
            rate = _prefill_rate(llm, tokens, smoke)
            linear_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                                and "scale" not in n)
            config = model.config
            attention = 2 * config.num_hidden_layers * config.hidden_size * tokens  # causal QK^T and PV per token
            flops_per_token = 2 * linear_params + attention
            ceiling_tokens = ceiling["fp8_flops"] / flops_per_token
            rows_out.append({"part": "prefill", "what": f"{fmt} {tokens} tokens", "value": rate, "unit": "tok/s",
                             "ceiling": ceiling_tokens, "ratio": rate / ceiling_tokens})
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def _decode_rate(llm, smoke: bool) -> float:
    if smoke:
        from tokenmill import SamplingParams

        llm.generate([[5] * 16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        return 1.0
    from gpu_bench import decode_rate

    return decode_rate(llm, 128, 128)


def _prefill_rate(llm, tokens: int, smoke: bool) -> float:
    if smoke:
        from tokenmill import SamplingParams

        llm.generate([[7] * tokens], SamplingParams(max_tokens=1, temperature=0))
        return 1.0
    from gpu_bench import prefill_rate

    return prefill_rate(llm, tokens)


def moe(device: torch.device, ceiling: dict[str, float], smoke: bool) -> list[dict]:
    from tokenmill.kernels.moe.experts import ExpertScales, fused_experts
    from tokenmill.layers.moe import RoutingConfig, fused_experts_ref, select_experts_ref
    from tokenmill.numerics import dequantize_blocks

    experts, top_k, hidden, inter = (8, 2, 256, 64) if smoke else (128, 8, 2048, 768)
    rows_out = []
    for fmt, block in (("fp8-block", (128, 128)), ("mxfp8", (1, 32))):
        w13, s13 = scaled_weight(experts * 2 * inter, hidden, block, device)
        w2, s2 = scaled_weight(experts * hidden, inter, block, device)
        w13, w2 = w13.view(experts, 2 * inter, hidden), w2.view(experts, hidden, inter)
        s13, s2 = s13.view(experts, -1, s13.shape[-1]), s2.view(experts, -1, s2.shape[-1])
        scales = ExpertScales(s13, s2, block, block)
        for tokens in (1, 20 if smoke else 2048):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            weights, ids = select_experts_ref(torch.randn(tokens, experts, device=device),
                                              RoutingConfig(experts, top_k, renormalize=True))
            got = fused_experts(x, w13, w2, weights, ids, scales=scales).float()
            ref = fused_experts_ref(x.float(), dequantize_blocks(w13, s13, block), dequantize_blocks(w2, s2, block),
                                    weights, ids)
            error = ((got - ref).abs().max() / ref.abs().max()).item()
            seconds = timed(lambda: fused_experts(x, w13, w2, weights, ids, scales=scales), device)
            if tokens == 1:
                per_expert = (w13[0].numel() + w2[0].numel() + (s13[0].numel() + s2[0].numel()) * s13.element_size())
                value, unit, ceiling_value = top_k * per_expert / seconds, "GB/s read", ceiling["copy_bytes_per_s"]
            else:
                value, unit = 2 * tokens * top_k * 3 * hidden * inter / seconds, "TFLOP/s"
                ceiling_value = ceiling["bf16_flops"]
            rows_out.append({"part": "moe", "what": f"{fmt} experts T={tokens}", "value": value, "unit": unit,
                             "ceiling": ceiling_value, "ratio": value / ceiling_value, "rel_error": error})
    return rows_out


def nvfp4_rows(device: torch.device, ceiling: dict[str, float], smoke: bool, parts: set[str],
               sweep: bool = False) -> list[dict]:
    import nvfp4_parts

    rates = (lambda llm: _decode_rate(llm, smoke), lambda llm, tokens: _prefill_rate(llm, tokens, smoke))
    rows = []
    if "nvfp4-linears" in parts:
        rows += nvfp4_parts.nvfp4_linears(device, ceiling, smoke, timed, sweep)
    if "nvfp4-decode" in parts:
        rows += nvfp4_parts.nvfp4_decode(device, ceiling, smoke, rates)
    if "nvfp4-moe" in parts:
        rows += nvfp4_parts.nvfp4_moe(device, ceiling, smoke, timed)
    if "dual-prefill" in parts:
        rows += nvfp4_parts.dual_prefill(device, ceiling, smoke, rates)
    return rows


PARTS = ("linears", "decode", "prefill", "moe", "nvfp4-linears", "nvfp4-decode", "nvfp4-moe", "dual-prefill")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--nvfp4-sweep", action="store_true", help="nvfp4-linears: every tile of nvfp4_parts.SWEEP too")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if parts - set(PARTS):
        parser.error(f"unknown parts {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    ceiling = ceilings(device, args.smoke)
    rows = []
    if "linears" in parts:
        rows += linears(device, ceiling, args.smoke)
    if parts & {"decode", "prefill"}:
        rows += engine(device, ceiling, args.smoke, parts)
    if "moe" in parts:
        rows += moe(device, ceiling, args.smoke)
    rows += nvfp4_rows(device, ceiling, args.smoke, parts, args.nvfp4_sweep)
    print(f"ceilings: copy {ceiling['copy_bytes_per_s'] / 1e9:.0f} GB/s, FP8 matmul {ceiling['fp8_flops'] / 1e12:.0f} "
          f"TFLOP/s, bf16 matmul {ceiling['bf16_flops'] / 1e12:.0f} TFLOP/s")
    for row in rows:
        scale = 1e12 if row["unit"] == "TFLOP/s" else 1e9 if row["unit"].startswith("GB") else 1
        error = f"  max rel err {row['rel_error']:.1e}" if "rel_error" in row else ""
        print(f"{row['part']:>13} | {row['what']:<46} | {row['value'] / scale:10.2f} {row['unit']:<9} | "
              f"{100 * row['ratio']:6.1f}% of {row['ceiling'] / scale:.1f}{error}")
    if args.json:
        args.json.write_text(json.dumps({"ceilings": ceiling, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The NVFP4 parts of quant_gpu_bench.py (its ceilings, its rows; each part well under three minutes
on an H200):

- nvfp4-linears: Llama-3.1-8B's projections as NVFP4 through the W4A16 kernel, each first
  checked against its reference: M = 1 (a CUDA graph of the call) against the bytes it reads
  (E2M1 codes, E4M3 scales, a float32 row scale: ~4.5 bits a weight) over the copy bandwidth;
  M = 2048 against the bf16 matmul rate (W4A16 multiplies in bf16). With --nvfp4-sweep, every
  tile of SWEEP too (rows "tile ..."), for kernels/nvfp4.nvfp4_tile.
- nvfp4-decode: the whole engine, Llama-3.1-8B shape with random NVFP4 weights (head kept bf16),
  batch-1 decode after a 128-token prompt against the roofline of the bytes a token reads.
  Target >= 80 %.
- nvfp4-moe: Qwen3-30B-A3B's routed experts (E = 128, k = 8, H = 2048, I = 768) in NVFP4: T = 1
  against the bytes of the 8 selected experts (target >= 75 %), T = 2048 against the bf16 rate.
- dual-prefill: one cold 2048-token prefill of the NVFP4 Llama-3.1-8B shape, NVFP4 only against
  --dual-weights nvfp4+fp8 (the FP8-rows copy multiplies on the FP8 tensor cores); and batch-1
  decode of the dual model, which must stay on the NVFP4 copy's rate.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from tokenmill.numerics import FP8_E4M3

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"qkv": (96, 128), "down": (64, 256)}
NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
SWEEP = {1: [(16, 128, 4, 4), (16, 256, 4, 4), (32, 256, 4, 4), (64, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 6),
             (128, 128, 8, 4), (32, 256, 8, 4)],
         2048: [(64, 128, 4, 4, 64), (128, 128, 8, 3, 128), (128, 64, 8, 4, 128), (128, 128, 8, 4, 64),
                (64, 128, 4, 3, 128), (128, 256, 8, 2, 128)]}
"""(block_n, block_k, warps, stages[, block_m]) tried per row count with --nvfp4-sweep."""


def random_nvfp4(rows: int, k: int, device: torch.device, lead: tuple[int, ...] = ()):
    """Random packed codes, E4M3 group scales around 1 and row scales of ~0.02 / 2.6 (values ~0.02)."""
    packed = torch.randint(0, 256, (*lead, rows, k // 2), dtype=torch.uint8, device=device)
    scale = (torch.rand(*lead, rows, k // 16, device=device) + 0.5).to(FP8_E4M3)
    row_scale = torch.full((*lead, rows), 0.02 / 2.6, device=device)
    return packed, scale, row_scale


def nvfp4_linears(device: torch.device, ceiling: dict[str, float], smoke: bool, timed, sweep: bool = False) -> list[dict]:
    from tokenmill.kernels.gemv import GemvTile
    from tokenmill.kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref

    rows_out = []
    for name, (n, k) in (SMOKE_SHAPES if smoke else SHAPES).items():
        packed, scale, row_scale = random_nvfp4(n, k, device)
        for m in (1, 24 if smoke else 2048):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x, packed, scale, row_scale)
            tiles = [None] + ([(GemvTile(*t[:4]), t[4] if len(t) > 4 else 16) for t in SWEEP[m]] if sweep and not smoke
                              else [])
            for tile in tiles:
                got = nvfp4_linear(x, packed, scale, row_scale, tile=tile).float()
                error = ((got - ref).abs().max() / ref.abs().max()).item()
                seconds = timed(lambda: nvfp4_linear(x, packed, scale, row_scale, tile=tile), device)
                if m == 1:
                    nbytes = packed.numel() + scale.numel() + 4 * n
                    value, ceiling_value, unit = nbytes / seconds, ceiling["copy_bytes_per_s"], "GB/s read"
                else:
                    value, ceiling_value, unit = 2 * m * n * k / seconds, ceiling["bf16_flops"], "TFLOP/s"
                label = "" if tile is None else f" tile {tile[0].block_n},{tile[0].block_k},{tile[0].num_warps}," \
                                                 f"{tile[0].num_stages} bm {tile[1]}"
                rows_out.append({"part": "nvfp4-linears", "what": f"nvfp4 {name} {n}x{k} M={m}{label}", "value": value,
                                 "unit": unit, "ceiling": ceiling_value, "ratio": value / ceiling_value,
                                 "rel_error": error})
    return rows_out


def llama_nvfp4_dir(smoke: bool) -> str:
    from gpu_bench import LLAMA_31_8B

    config = dict(LLAMA_31_8B, quantization_config=NVFP4_CONFIG)
    if smoke:
        config.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)
    directory = tempfile.mkdtemp(prefix="quant_bench_nvfp4_")
    Path(directory, "config.json").write_text(json.dumps(config))
    return directory


def nvfp4_llm(device: torch.device, smoke: bool, eager: bool = False, **options):
    from tokenmill import LLM

    return LLM(llama_nvfp4_dir(smoke), load_format="dummy", max_model_len=4096, device=device.type, max_num_seqs=4,
               kv_cache_bytes=(1 << 24) if smoke else 8 << 30, enforce_eager=smoke or eager, **options)


def token_bytes(llm) -> int:
    """What one batch-1 decode step reads of the weights (every parameter of the one copy a decode
    step uses, one embedding row); a dual model's second copies are not read."""
    model = llm.engine.runner.model
    second = {id(p) for m in model.modules() if hasattr(m, "second_copy") for p in m.second_copy.parameters()}
    params = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in second)
    embed = model.model.embed_tokens.weight
    return params - embed.numel() * embed.element_size() + embed[0].numel() * embed.element_size()


def prefill_flops_per_token(llm, tokens: int) -> float:
    model = llm.engine.runner.model
    config = model.config
    linear = sum(m.in_features * m.out_features for n, m in model.named_modules()
                 if hasattr(m, "in_features") and hasattr(m, "output_sizes") and "second_copy" not in n)
    return 2 * linear + 2 * config.num_hidden_layers * config.hidden_size * tokens


def nvfp4_decode(device: torch.device, ceiling: dict[str, float], smoke: bool, rates) -> list[dict]:
    decode_rate, _ = rates
    llm = nvfp4_llm(device, smoke)
    rate = decode_rate(llm)
    roofline = ceiling["copy_bytes_per_s"] / token_bytes(llm)
    nvfp4 = [m for m in llm.engine.runner.model.modules() if getattr(m, "weight", None) is not None
             and hasattr(m, "output_sizes") and m.weight.dtype == torch.uint8]
    bits = 8 * sum(p.numel() * p.element_size() for m in nvfp4 for p in m.parameters() if p is not m.bias) / sum(
        m.in_features * m.out_features for m in nvfp4)
    return [{"part": "nvfp4-decode", "what": f"w4a16 batch 1 after 128, body {bits:.2f} bits/w", "value": rate,
             "unit": "tok/s", "ceiling": roofline, "ratio": rate / roofline}]


def dual_prefill(device: torch.device, ceiling: dict[str, float], smoke: bool, rates) -> list[dict]:
    decode_rate, prefill_rate = rates
    tokens = 64 if smoke else 2048
    rows_out, measured = [], {}
    for label, options in (("nvfp4 only", {"eager": True}), ("dual nvfp4+fp8", {"dual_weights": "nvfp4+fp8"})):
        llm = nvfp4_llm(device, smoke, **options)
        measured[label] = rate = prefill_rate(llm, tokens)
        flops = prefill_flops_per_token(llm, tokens)
        peak = ceiling["fp8_flops" if "dual_weights" in options else "bf16_flops"]
        rows_out.append({"part": "dual-prefill", "what": f"{label} prefill {tokens}", "value": rate, "unit": "tok/s",
                         "ceiling": peak / flops, "ratio": rate * flops / peak})
        if "dual_weights" in options:  # decode must keep the NVFP4 copy's rate
            rate = decode_rate(llm)
            roofline = ceiling["copy_bytes_per_s"] / token_bytes(llm)
            rows_out.append({"part": "dual-prefill", "what": "dual nvfp4+fp8 batch 1 decode", "value": rate,
                             "unit": "tok/s", "ceiling": roofline, "ratio": rate / roofline})
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    speedup = measured["dual nvfp4+fp8"] / measured["nvfp4 only"]
    rows_out.append({"part": "dual-prefill", "what": f"dual / nvfp4-only prefill {tokens}", "value": speedup,
                     "unit": "x", "ceiling": 1.0, "ratio": speedup})
    return rows_out


def nvfp4_moe(device: torch.device, ceiling: dict[str, float], smoke: bool, timed) -> list[dict]:
    from tokenmill.kernels.moe.experts import ExpertScales, fused_experts
    from tokenmill.layers.moe import RoutingConfig, fused_experts_ref, select_experts_ref
    from tokenmill.numerics import dequantize_nvfp4

    experts, top_k, hidden, inter = (8, 2, 256, 64) if smoke else (128, 8, 2048, 768)
    w13, s13, r13 = random_nvfp4(2 * inter, hidden, device, (experts,))
    w2, s2, r2 = random_nvfp4(hidden, inter, device, (experts,))
    scales = ExpertScales(s13, s2, (1, 16), (1, 16), r13, r2)
    d13, d2 = dequantize_nvfp4(w13, s13, r13[..., None]), dequantize_nvfp4(w2, s2, r2[..., None])
    rows_out = []
    for tokens in (1, 20 if smoke else 2048):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        weights, ids = select_experts_ref(torch.randn(tokens, experts, device=device),
                                          RoutingConfig(experts, top_k, renormalize=True))
        got = fused_experts(x, w13, w2, weights, ids, scales=scales).float()
        ref = fused_experts_ref(x.float(), d13, d2, weights, ids)
        error = ((got - ref).abs().max() / ref.abs().max()).item()
        seconds = timed(lambda: fused_experts(x, w13, w2, weights, ids, scales=scales), device)
        if tokens == 1:
            per_expert = sum(t[0].numel() * t.element_size() for t in (w13, w2, s13, s2, r13, r2))
            value, unit, ceiling_value = top_k * per_expert / seconds, "GB/s read", ceiling["copy_bytes_per_s"]
        else:
            value, unit, ceiling_value = 2 * tokens * top_k * 3 * hidden * inter / seconds, "TFLOP/s", ceiling["bf16_flops"]
        rows_out.append({"part": "nvfp4-moe", "what": f"nvfp4 experts T={tokens}", "value": value, "unit": unit,
                         "ceiling": ceiling_value, "ratio": value / ceiling_value, "rel_error": error})
    return rows_out

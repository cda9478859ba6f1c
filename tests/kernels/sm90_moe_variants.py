"""The MoE kernels' sm_90 variants for sm90_compile.py: Qwen3-30B-A3B's layer (E = 128, k = 8,
H = 2048, I = 768) at the token counts of each path and tile, and the routers of every kind."""

from __future__ import annotations

from tokenmill.kernels.moe.align import CHUNK, _count_kernel, _place_kernel, _starts_kernel
from tokenmill.kernels.moe.combine import BLOCK_H, _combine_kernel
from tokenmill.kernels.moe.few_row import FEW_ROWS, _few_row_down_kernel, _few_row_gate_up_kernel, few_row_tiles
from tokenmill.kernels.moe.grouped_gemm import _down_kernel, _gate_up_kernel, grouped_tiles
from tokenmill.kernels.moe.routing import _route_kernel, route_launch_config

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
NO_SCALES = dict(HAS_SCALE=False, SCALE_ROWS=1, SCALE_COLS=0, E8M0=False, FP4=False)
# FP8 experts: one scale per row, 128 x 128 blocks (I = 768 is 6 blocks), MX groups of 32; NVFP4
# experts: packed uint8 weights, E4M3 scales per 16 and a float32 scale per row.
FP8_SCALES = {"fp8 rows": ("fp8e4nv", "fp32", dict(HAS_SCALE=True, SCALE_ROWS=1, SCALE_COLS=0, E8M0=False, FP4=False)),
              "fp8 block128": ("fp8e4nv", "fp32", dict(HAS_SCALE=False, SCALE_ROWS=128, SCALE_COLS=128, E8M0=False,
                                                       FP4=False)),
              "mxfp8": ("fp8e4nv", "u8", dict(HAS_SCALE=False, SCALE_ROWS=1, SCALE_COLS=32, E8M0=True, FP4=False)),
              "nvfp4": ("u8", "fp8e4nv", dict(HAS_SCALE=True, SCALE_ROWS=1, SCALE_COLS=16, E8M0=False, FP4=True))}


def moe_variants(quick: bool = False):
    """(label, kernel, types, constexprs, warps, stages), as sm90_compile.other_variants; quick
    (CI) leaves out the widest router and the largest prefill tile."""
    routers = [("qwen3-30b softmax", 128, 8, 1, 1, False), ("deepseek-v3 sigmoid grouped", 256, 8, 8, 4, True)]
    for label, experts, top_k, groups, topk_group, sigmoid in routers + ([] if quick else [
        ("qwen3-next softmax", 512, 10, 1, 1, False)]):
        launch = route_launch_config(experts, groups, top_k)
        warps = launch.pop("num_warps")
        yield (f"moe route {label}", _route_kernel,
               {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32", "scale": "fp32"},
               dict(TOP_K=top_k, N_GROUP=groups, TOPK_GROUP=topk_group, SIGMOID=sigmoid, HAS_BIAS=sigmoid,
                    TOP2_GROUP_SCORE=sigmoid, RENORMALIZE=True, **launch), warps, 1)
    ints = {"ids_ptr": "*i32", "counts_ptr": "*i32", "starts_ptr": "*i32", "cursor_ptr": "*i32", "sorted_ptr": "*i32"}
    yield "moe align count", _count_kernel, ints, dict(CHUNK=CHUNK, BINS=256), 4, 1
    yield "moe align starts", _starts_kernel, ints, dict(BLOCK_M=64, BLOCK_E=128), 4, 1
    yield "moe align place", _place_kernel, ints, dict(CHUNK=CHUNK), 4, 1
    weights = [("bf16", "bf16", NO_SCALES)] + list(FP8_SCALES.values())
    labels = ["bf16", *FP8_SCALES]
    for label, (weight, scale_type, scaling) in zip(labels, weights):
        if quick and label == "fp8 rows":
            continue
        for tokens in (64, 2048) if quick or label != "bf16" else (64, 2048, 8192):
            gate_up, down = grouped_tiles(tokens * TOP_K, EXPERTS)
            types = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "act_ptr": "*bf16", "weights_ptr": "*fp32",
                     "out_ptr": "*bf16", "s_ptr": f"*{scale_type}", "r_ptr": "*fp32", **ints}
            common = dict(BLOCK_E=EXPERTS, EVEN_K=True, UPCAST=False, IEEE=False, **scaling)
            yield (f"moe grouped gate-up T={tokens} {label}", _gate_up_kernel, types,
                   dict(TOP_K=TOP_K, BLOCK_M=gate_up.block_m, BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k, **common),
                   gate_up.num_warps, gate_up.num_stages)
            yield (f"moe grouped down T={tokens} {label}", _down_kernel, types,
                   dict(BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, **common),
                   down.num_warps, down.num_stages)
        gate_up, down = few_row_tiles()
        types = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "ids_ptr": "*i32", "act_ptr": "*bf16", "weights_ptr": "*fp32",
                 "out_ptr": "*bf16", "s_ptr": f"*{scale_type}", "r_ptr": "*fp32"}
        common = dict(TOP_K=TOP_K, BLOCK_S=FEW_ROWS * TOP_K, ROWS=FEW_ROWS, EVEN_K=True, UPCAST=False, IEEE=False,
                      **scaling)
        yield (f"moe few-row gate-up T={FEW_ROWS} {label}", _few_row_gate_up_kernel, types,
               dict(BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k, LAUNCH_NEXT=True, **common),
               gate_up.num_warps, gate_up.num_stages)
        yield (f"moe few-row down T={FEW_ROWS} {label} (dependent launch)", _few_row_down_kernel, types,
               dict(BLOCK_N=down.block_n, BLOCK_K=down.block_k, PDL=True, **common), down.num_warps, down.num_stages)
    yield ("moe combine", _combine_kernel, {"slot_ptr": "*bf16", "add_ptr": "*bf16", "gate_ptr": "*bf16", "out_ptr": "*bf16"},
           dict(TOP_K=TOP_K, HAS_ADD=True, HAS_GATE=True, BLOCK_H=BLOCK_H), 4, 1)

"""The sm_90 variants of FP8 checkpoint weights for sm90_compile.py: Llama-3.1-8B's projections
(qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) with 128 x 128 block
scales and MX (E8M0 per 32) scales, through the few-row kernels, fp8_linear's many-row tiles, the
activation quantizer and the W8A8 block-scaled GEMM."""

from __future__ import annotations

from tokenmill.kernels.few_row_mma import MMA_ROWS, _few_row_mma_kernel, few_row_mma_tile, many_rows_tile
from tokenmill.kernels.fp8_gemm import GROUP, _block_gemm_kernel, _quantize_kernel, block_gemm_tile
from tokenmill.kernels.gemv import _gemv_kernel, gemv_tile
from tokenmill.kernels.w8a8_few_row import MMA_ROWS as W8A8_ROWS
from tokenmill.kernels.w8a8_few_row import _w8a8_few_row_kernel, w8a8_few_row_tile

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SCALES = {"block128": (128, 128, "fp32"), "mx32": (1, 32, "u8")}


def fp8_variants(quick: bool = False):
    """(label, kernel, types, constexprs, warps, stages), as sm90_compile.other_variants."""
    shapes = {k: SHAPES[k] for k in ("qkv", "down")} if quick else SHAPES
    for scale_name, (rows_per, cols_per, scale_type) in SCALES.items():
        scaling = dict(SCALE_ROWS=rows_per, SCALE_COLS=cols_per, E8M0=scale_type == "u8")
        types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": f"*{scale_type}", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
        for name, (n, k) in shapes.items():
            for rows in (1, 8):
                tile = gemv_tile(n, k, rows, True)
                yield (f"gemv {name} {n}x{k} fp8 {scale_name} rows={rows}", _gemv_kernel, types,
                       dict(ROWS=rows, HAS_SCALE=False, HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                            EVEN_K=True, PDL=True, **scaling), tile.num_warps, tile.num_stages)
            tile = few_row_mma_tile(n, k)
            yield (f"few_row_mma {name} {n}x{k} fp8 {scale_name}", _few_row_mma_kernel, types,
                   dict(HAS_SCALE=False, HAS_BIAS=False, BLOCK_M=MMA_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                        EVEN_K=True, UPCAST=False, IEEE=False, PDL=True, **scaling), tile.num_warps, tile.num_stages)
            if scale_name == "mx32":
                tile, block_m = many_rows_tile(n)
                yield (f"fp8_linear {name} {n}x{k} mx32, many rows", _few_row_mma_kernel, types,
                       dict(HAS_SCALE=False, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                            EVEN_K=True, UPCAST=False, IEEE=False, PDL=False, **scaling), tile.num_warps, tile.num_stages)
    for name, (n, k) in shapes.items():
        for grouped in (False, True):
            tile = w8a8_few_row_tile(n, k, grouped)
            for one_row, splits in ((True, 1), (True, 4), (False, 4)):
                yield (f"w8a8 few-row {name} {n}x{k} {'block128' if grouped else 'rows'} one_row={one_row} "
                       f"splits={splits}",
                       _w8a8_few_row_kernel,
                       {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
                        "part_ptr": "*fp32", "count_ptr": "*i32"},
                       dict(GROUPED=grouped, SPLITS=splits, SCALE_ROWS=128 if grouped else 1, HAS_BIAS=False, BLOCK_M=W8A8_ROWS,
                            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ONE_ROW=one_row, EVEN_K=True, PDL=True,
                            EMULATE_ROUNDING=False, UPCAST=False), tile.num_warps, tile.num_stages)
    yield ("quantize activations per 128", _quantize_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
           dict(BLOCK=GROUP, EMULATE_ROUNDING=False), 4, 1)
    yield ("quantize activations per token", _quantize_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
           dict(BLOCK=1024, EMULATE_ROUNDING=False), 4, 1)
    for rows in (64, 2048):
        block_m, block_n, warps, stages = block_gemm_tile(rows)
        yield (f"w8a8 block GEMM M={rows}", _block_gemm_kernel,
               {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "bias_ptr": "*bf16",
                "c_ptr": "*bf16"},
               dict(SCALE_ROWS=128, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUP_M=8,
                    UPCAST=False), warps, stages)

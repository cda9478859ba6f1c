"""The sm_90 variants of NVFP4 weights for sm90_compile.py: Llama-3.1-8B's projections (qkv
6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336, the head 128256 x 4096)
through the W4A16 kernel at the tiles decode (1 row, dependent launch), verification (5 rows)
and prefill (2048 rows) pick, and W4A4's activation quantizer. The MoE kernels' NVFP4 variants
are in sm90_moe_variants.py."""

from __future__ import annotations

from tokenmill.kernels.nvfp4 import _nvfp4_linear_kernel, _quantize_nvfp4_kernel, nvfp4_tile

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
TYPES = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp8e4nv", "r_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}


def nvfp4_variants(quick: bool = False):
    """(label, kernel, types, constexprs, warps, stages), as sm90_compile.other_variants."""
    shapes = {k: SHAPES[k] for k in ("qkv", "down")} if quick else SHAPES
    for name, (n, k) in shapes.items():
        for rows in (1, 5, 2048):
            tile, block_m = nvfp4_tile(n, k, rows)
            pdl = block_m == 16
            yield (f"nvfp4 w4a16 {name} {n}x{k} rows={rows}{' (dependent launch)' if pdl else ''}", _nvfp4_linear_kernel,
                   TYPES, dict(HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=True,
                               UPCAST=False, IEEE=False, PDL=pdl), tile.num_warps, tile.num_stages)
    yield ("nvfp4 quantize activations", _quantize_nvfp4_kernel,
           {"x_ptr": "*bf16", "g_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp8e4nv"},
           dict(BLOCK_G=64, EMULATE_ROUNDING=False), 4, 1)

"""Compile every kernel variant the GPU path launches for sm_90 (Hopper) with no GPU present:
Triton's own front end, LLVM and the ptxas that ships in its wheel. Catches what the
interpreter cannot (layout and dot-shape limits, FP8 casts, shared-memory overflow), an FMA in
the kernels that must round as PyTorch does, and a programmatic dependent that writes before
(or never) waits for the kernel it follows.

Run as a script (`python tests/kernels/sm90_compile.py`) it prints one line per variant. It
must run with TRITON_INTERPRET unset, so test_sm90_compile.py runs it in a subprocess. It uses
Triton's compiler entry points (ASTSource, GPUTarget), which are not a stable API.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
from sm90_fp8_variants import fp8_variants  # beside this script
from sm90_gdn_variants import gdn_variants  # beside this script
from sm90_moe_variants import moe_variants  # beside this script
from sm90_nvfp4_variants import nvfp4_variants  # beside this script
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.activation import _silu_and_mul_kernel
from tokenmill.kernels.attention import plan_attention
from tokenmill.kernels.few_row_mma import MMA_ROWS, _few_row_mma_kernel, few_row_mma_tile, many_rows_tile
from tokenmill.kernels.gemv import _gemv_kernel, gemv_tile
from tokenmill.kernels.kv_cache import _write_kv_kernel
from tokenmill.kernels.latent_cache import _write_latent_kernel
from tokenmill.kernels.mla_absorbed import _merge_kernel as _mla_merge_kernel
from tokenmill.kernels.mla_absorbed import _mla_absorbed_kernel
from tokenmill.kernels.mla_decode import plan_absorbed
from tokenmill.kernels.mla_prefill import _mla_prefill_kernel
from tokenmill.kernels.paged_attention import _merge_kernel, _paged_attention_kernel
from tokenmill.kernels.qsa_index import _block_scores_kernel, score_block_size
from tokenmill.kernels.rms_norm import _rms_norm_kernel
from tokenmill.kernels.rotary import LAUNCH as ROTARY_LAUNCH
from tokenmill.kernels.rotary import _rotary_cache_kernel, _rotary_kernel
from tokenmill.kernels.sparse_attention import _sparse_attention_kernel, plan_sparse

TARGET = GPUTarget("cuda", 90, 32)
ROW_SCALES = dict(SCALE_ROWS=1, SCALE_COLS=0, E8M0=False)  # a scale per row of W (or none)
MAX_SHARED = 232448  # bytes of shared memory one sm_90 block may use
# Kernels that must round every bf16 product as PyTorch does: no fused multiply-add in their code.
ROUNDED = (_rotary_kernel, _rotary_cache_kernel)
# Integer arguments every launch passes as multiples of 16 (Triton specialises those as divisible).
ALIGNED_INTS = ("k_per_split",)
TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv"}


def compile_variant(fn, types: dict[str, str], consts: dict[str, object], num_warps: int, num_stages: int = 3):
    """Compile as the launcher would, with pointers and strides 16-divisible like real launches."""
    fusion = ROTARY_LAUNCH["enable_fp_fusion"] if fn in ROUNDED else True
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n in ALIGNED_INTS)
    }
    src = ASTSource(fn, sig, constexprs=consts, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fusion}
    return triton.compile(src, target=TARGET, options=options)


def attention_variants():
    """(label, kernel, types, constexprs, warps, stages) for the shapes the engine runs."""
    models = [(32, 8, 128), (16, 16, 64), (16, 8, 256), (28, 4, 128), (16, 2, 256)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kv_dtype in (dtype, torch.float8_e4m3fn):
            for heads, kv_heads, head_dim in models if dtype == torch.bfloat16 else models[:1]:
                for max_q, causal, window in ((1, True, 0), (2048, True, 0), (16, False, 0), (16, False, 2048)):
                    plan = plan_attention(
                        num_tokens=max_q, num_requests=1, max_query_len=max_q, max_seq_len=32768,
                        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                        device=torch.device("cuda"), num_splits=8 if max_q == 1 else 1,
                        kv_dtype=kv_dtype,
                    )
                    group = heads // kv_heads
                    types = {
                        "out_ptr": f"*{TL[dtype]}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                        "q_ptr": f"*{TL[dtype]}", "k_cache_ptr": f"*{TL[kv_dtype]}", "v_cache_ptr": f"*{TL[kv_dtype]}",
                        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
                        "qk_scale": "fp32", "v_scale": "fp32",
                    }
                    consts = dict(
                        GROUP=group, GROUP_P=triton.next_power_of_2(group), HEAD_DIM=head_dim,
                        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
                        BLOCK_N=plan.block_n, PAGE=16, SPLIT=plan.split, MIN_SPLIT_TILES=plan.min_split_tiles,
                        UPCAST=False, IEEE=dtype == torch.float32,
                        F16_DOT=kv_dtype == torch.float8_e4m3fn and dtype == torch.bfloat16, LAUNCH_NEXT=True,
                        CAUSAL=causal, WINDOW=window,
                    )
                    label = (f"attention {TL[dtype]} kv={TL[kv_dtype]} H={heads}/{kv_heads} D={head_dim} q={max_q}"
                             + ("" if causal else " non-causal") + (f" window {window}" if window else ""))
                    yield label, _paged_attention_kernel, types, consts, plan.num_warps, plan.num_stages


def other_variants():
    for head_dim in (64, 128, 256):
        types = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qsl_ptr": "*i32"}
        yield (f"merge D={head_dim}", _merge_kernel, types,
               dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, SPLITS_P=64, LAUNCH_NEXT=True), 4, 1)
    for cache in ("bf16", "fp8e4nv"):
        yield (f"write_kv cache={cache}", _write_kv_kernel,
               {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": f"*{cache}", "slot_ptr": "*i64",
                "k_scale": "fp32", "v_scale": "fp32"},
               dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P=8, DIM_P=128, PAGE=16, QUANT=cache != "bf16",
                    EMULATE_ROUNDING=False), 4, 1)
    for n, k, rows, weight in ((6144, 4096, 1, "bf16"), (4096, 14336, 1, "bf16"), (3072, 2048, 1, "bf16"),
                               (6144, 4096, 5, "bf16"), (4096, 14336, 8, "bf16"), (16384, 2048, 1, "fp8e4nv"),
                               (2048, 8192, 1, "fp8e4nv"), (2048, 8192, 2, "fp8e4nv")):
        tile = gemv_tile(n, k, rows, weight != "bf16")
        types = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
        yield (f"gemv {n}x{k} {weight} rows={rows} (dependent launch)", _gemv_kernel, types,
               dict(ROWS=rows, HAS_SCALE=weight != "bf16", HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                    EVEN_K=True, PDL=True, **ROW_SCALES), tile.num_warps, tile.num_stages)
    for n, k, weight in ((6144, 4096, "bf16"), (4096, 14336, "bf16"), (3072, 2048, "fp8e4nv"), (16384, 2048, "fp8e4nv")):
        tile = few_row_mma_tile(n, k)
        types = {"x_ptr": "*bf16", "w_ptr": f"*{weight}", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"}
        yield (f"few_row_mma {n}x{k} {weight} (dependent launch)", _few_row_mma_kernel, types,
               dict(HAS_SCALE=weight != "bf16", HAS_BIAS=False, BLOCK_M=MMA_ROWS, BLOCK_N=tile.block_n,
                    BLOCK_K=tile.block_k, EVEN_K=True, UPCAST=False, IEEE=False, PDL=True, **ROW_SCALES),
               tile.num_warps, tile.num_stages)
    for n in (2048, 16384):
        tile, block_m = many_rows_tile(n)
        yield (f"fp8_linear N={n}, many rows (dependent launch)", _few_row_mma_kernel,
               {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16"},
               dict(HAS_SCALE=True, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                    EVEN_K=True, UPCAST=False, IEEE=False, PDL=True, **ROW_SCALES), tile.num_warps, tile.num_stages)
    yield ("rms_norm+residual 4096", _rms_norm_kernel,
           {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16", "eps": "fp32"},
           dict(BLOCK=4096, HAS_RESIDUAL=True, LAUNCH_NEXT=True, STEER=False, PROBE=False), 8, 1)
    # Steering (layers/steering.py): the ablation before the add, with and without the probe, and the first layer's.
    steered = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
               "dir_ptr": "*fp32", "strength_ptr": "*fp32", "rows_ptr": "*i64", "probe_ptr": "*fp32", "eps": "fp32"}
    for residual, probe in ((True, False), (True, True), (False, False)):
        yield (f"steered rms_norm 4096 residual={residual} probe={probe}", _rms_norm_kernel, steered,
               dict(BLOCK=4096, HAS_RESIDUAL=residual, LAUNCH_NEXT=True, STEER=True, PROBE=probe), 8, 1)
    yield ("silu_and_mul", _silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BLOCK=1024, LAUNCH_NEXT=True), 4, 1)
    yield ("rotary D=128", _rotary_kernel,
           {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
           dict(HALF=64, HALF_P=64, QH_P=32, KH_P=8), ROTARY_LAUNCH["num_warps"], 1)
    for cache in ("bf16", "fp8e4nv"):
        yield (f"rotary+KV write D=128 cache={cache}", _rotary_cache_kernel,
               {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*fp32",
                "sin_ptr": "*fp32", "cache_ptr": f"*{cache}", "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32"},
               dict(HALF=64, HALF_P=64, QH_P=32, KH_P=8, PAGE=16, QUANT=cache != "bf16", EMULATE_ROUNDING=False),
               ROTARY_LAUNCH["num_warps"], 1)
    # Qwen3-Next / Qwen3.5: (1 + w) norms multiply by a float32 weight (float32 out), rotary on 64 of 256 channels.
    norm_types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "res_out_ptr": "*bf16",
                  "eps": "fp32"}
    yield ("zero-centred rms_norm+residual 2048", _rms_norm_kernel, norm_types,
           dict(BLOCK=2048, HAS_RESIDUAL=True, LAUNCH_NEXT=True, STEER=False, PROBE=False), 8, 1)
    yield ("zero-centred q/k norm D=256", _rms_norm_kernel, norm_types,
           dict(BLOCK=256, HAS_RESIDUAL=False, LAUNCH_NEXT=True, STEER=False, PROBE=False), 4, 1)
    yield ("partial rotary 64 of D=256", _rotary_kernel,
           {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
           dict(HALF=32, HALF_P=32, QH_P=16, KH_P=2), ROTARY_LAUNCH["num_warps"], 1)


def mla_variants():
    """The absorbed MLA kernel at the plans chosen for DeepSeek-V2-Lite (16 heads) and V3 (128
    heads), 512 + 64 latent, decode and 1 + 4 verification; the merge, prefill and write kernels."""
    for heads, cache, max_q in ((16, "bf16", 1), (16, "fp8e4nv", 1), (16, "bf16", 5), (16, "fp8e4nv", 5), (128, "bf16", 1)):
        plan = plan_absorbed(num_tokens=max_q, num_requests=1, max_query_len=max_q, max_seq_len=32768, num_heads=heads,
                             device=torch.device("cuda"), fp8_cache=cache != "bf16", num_splits=64)
        types = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "q_lat_ptr": "*bf16",
                 "q_pe_ptr": "*bf16", "cache_ptr": f"*{cache}", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "qsl_ptr": "*i32", "qk_scale": "fp32", "v_scale": "fp32"}
        consts = dict(LATENT=512, ROPE=64, LATENT_P=512, ROPE_P=64, BLOCK_H=plan.block_h, BLOCK_Q=plan.block_q,
                      BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, PAGE=64, SPLIT=plan.split,
                      MIN_SPLIT_TILES=plan.min_split_tiles, UPCAST=False, IEEE=False, F16_DOT=cache != "bf16")
        yield (f"mla absorbed cache={cache} H={heads} q={max_q}", _mla_absorbed_kernel, types, consts, plan.num_warps,
               plan.num_stages)
    yield ("mla merge 512 x 128 splits", _mla_merge_kernel,
           {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qsl_ptr": "*i32"},
           dict(LATENT=512, BLOCK_D=32, SPLITS_P=128), 4, 1)
    yield ("mla prefill 128+64 / 128", _mla_prefill_kernel,
           {"out_ptr": "*bf16", "q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "k_nope_ptr": "*bf16", "k_pe_ptr": "*bf16",
            "v_ptr": "*bf16", "qsl_ptr": "*i32", "kv_starts_ptr": "*i64", "seq_lens_ptr": "*i32", "qk_scale": "fp32"},
           dict(NOPE=128, ROPE=64, VDIM=128, NOPE_P=128, ROPE_P=64, VDIM_P=128, BLOCK_M=64, BLOCK_N=64, UPCAST=False,
                IEEE=False), 8, 2)
    write_types = {"latent_ptr": "*bf16", "pe_ptr": "*bf16", "slot_ptr": "*i64", "scale": "fp32", "q_ptr": "*bf16",
                   "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "norm_w_ptr": "*bf16", "eps": "fp32",
                   "attention_factor": "fp32"}
    for cache, heads, rotate in (("bf16", 0, 0), ("fp8e4nv", 16, 1), ("fp8e4nv", 128, 2)):
        label = f"mla latent write cache={cache}" if not heads else f"mla prepare (norm, rope {rotate}) cache={cache} H={heads}"
        yield (label, _write_latent_kernel, dict(write_types, cache_ptr=f"*{cache}"),
               dict(LATENT=512, HALF=32, LATENT_P=512, HALF_P=32, HEADS_P=max(1, heads), Q_PE=128, NORM=heads > 0,
                    ROTATE=rotate, PAGE=64, QUANT=cache != "bf16", EMULATE_ROUNDING=False), 4, 1)


def qsa_variants():
    """Qwen4Exp's QSA at the real attention shape (16 query / 2 KV heads of 256, budget 2048 in
    blocks of 4: 512 listed blocks), bf16 and FP8 K/V, decode (split) and prefill; the block
    scores at index heads of 128 (16 and 64 heads: the published config does not fix them)."""
    cuda = torch.device("cuda")
    for cache in ("bf16", "fp8e4nv"):
        for tokens in (1, 2048):
            plan = plan_sparse(num_tokens=tokens, num_kv_heads=2, block_topk=512, ratio=4, head_dim=256, device=cuda,
                               num_splits=16 if tokens == 1 else 1)
            types = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "q_ptr": "*bf16",
                     "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "blocks_ptr": "*i32",
                     "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "qk_scale": "fp32",
                     "v_scale": "fp32"}
            consts = dict(GROUP=8, HEAD_DIM=256, BLOCK_D=256, BLOCK_M=16, BLOCK_N=plan.block_n, TOPK=512, RATIO=4,
                          PAGE=16, SPLIT=plan.split, MIN_SPLIT_TILES=plan.min_split_tiles, UPCAST=False, IEEE=False,
                          F16_DOT=cache != "bf16", LAUNCH_NEXT=True)
            yield (f"qsa sparse attention kv={cache} H=16/2 D=256 q={tokens}", _sparse_attention_kernel, types, consts,
                   plan.num_warps, plan.num_stages)
    for heads in (16, 64):
        types = {"scores_ptr": "*fp32", "q_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "score_scale": "fp32"}
        consts = dict(NUM_HEADS=heads, HEADS_P=heads, HEAD_DIM=128, DIM_P=128, RATIO=4, PAGE=16,
                      BLOCK_C=score_block_size(cuda), UPCAST=False, IEEE=False)
        yield f"qsa block scores NH={heads} D=128", _block_scores_kernel, types, consts, 4, 2


QUICK_MLA = {"mla absorbed cache=bf16 H=16 q=1", "mla absorbed cache=fp8e4nv H=16 q=1", "mla absorbed cache=bf16 H=16 q=5",
             "mla merge 512 x 128 splits", "mla prefill 128+64 / 128", "mla prepare (norm, rope 1) cache=fp8e4nv H=16"}


def waits_before_writing(ptx: str) -> bool:
    """A programmatic dependent's code: one griddepcontrol.wait, and no global store or atomic
    before it (what it may do early is read memory no other kernel writes: its weights)."""
    if ptx.count("griddepcontrol.wait") != 1:
        return False
    before = ptx.split("griddepcontrol.wait")[0]
    return not re.search(r"^\s*(?:@!?%p\d+\s+)?(?:st\.global|atom\.|red\.)", before, re.MULTILINE)


def stack_bytes(kernel) -> int | None:
    """Per-thread stack of the compiled kernel (register spills live there), from the cuobjdump
    in Triton's wheel; None where it cannot be read."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True).stdout
    found = re.search(r"STACK:(\d+)", usage)
    return int(found.group(1)) if found else None


def main(quick: bool = False) -> int:
    failures = 0
    variants = list(attention_variants()) + list(other_variants()) + list(moe_variants()) + list(mla_variants())
    variants += list(gdn_variants()) + list(qsa_variants()) + list(fp8_variants()) + list(nvfp4_variants())
    if quick:  # CI: the Llama-shaped bf16 and fp8 attention, the small and MoE kernels, MLA decode and verification
        variants = [v for v in variants if "H=32/8" in v[0] and v[0].startswith("attention bf16")] + list(other_variants())
        variants += list(moe_variants(quick=True)) + [v for v in mla_variants() if v[0] in QUICK_MLA]
        variants += list(gdn_variants(quick=True)) + list(qsa_variants()) + list(fp8_variants(quick=True))
        variants += list(nvfp4_variants(quick=True))
    for label, fn, types, consts, warps, stages in variants:
        try:
            kernel = compile_variant(fn, types, consts, warps, stages)
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        shared = kernel.metadata.shared
        ptx = kernel.asm["ptx"]
        fused = fn in ROUNDED and "fma.rn" in ptx
        early = consts.get("PDL", False) and not waits_before_writing(ptx)
        ok = shared <= MAX_SHARED and not fused and not early
        failures += not ok
        note = " (a product enters an FMA unrounded)" if fused else ""
        note += " (a dependent launch writes before, or never, waits)" if early else ""
        print(f"{'ok  ' if ok else 'FAIL'} {label}: warps={warps} stages={stages} shared={shared} "
              f"stack={stack_bytes(kernel)}{note}")
    print(f"{len(variants) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))

"""The linear-attention kernels' sm_90 variants for sm90_compile.py: the gated delta rule at
Qwen3-Next's heads (16 key / 32 value of 128), Qwen4Exp's (16 / 48) and Kimi-Linear's KDA
(32 / 32, per-channel gate), chunked prefill and recurrent decode/verification with float32 and
bfloat16 state; causal conv1d at Qwen3-Next's conv width (2 x 16 x 128 + 32 x 128)."""

from __future__ import annotations

from tokenmill.kernels.causal_conv1d_triton import PREFILL_TILE, UPDATE_TILE, _conv_prefill_kernel, _conv_update_kernel
from tokenmill.kernels.gated_delta_chunk import (
    CHUNK_BLOCK_V,
    PREPARE_WARPS,
    SCAN_WARPS,
    _chunk_prepare_kernel,
    _chunk_scan_kernel,
)
from tokenmill.kernels.gated_delta_recurrent import MAX_BLOCK_V, _recurrent_kernel, recurrent_warps

# (label, value heads per key head, per-channel gate)
MODELS = (("qwen3-next 16/32", 2, False), ("qwen4exp 16/48", 3, False), ("kimi-linear kda 32/32", 1, True))
INTS = {"slots_ptr": "*i32", "cu_seqlens_ptr": "*i32", "has_initial_ptr": "*i8", "checkpoint_ptr": "*i32",
        "chunk_starts_ptr": "*i32", "chunk_offsets_ptr": "*i32"}


def gdn_variants(quick: bool = False):
    """(label, kernel, types, constexprs, warps, stages), as sm90_compile.other_variants; quick
    (CI) keeps Qwen3-Next's and the KDA shapes with one state dtype each."""
    heads = dict(DK=128, DV=128, DK_P=128)
    for label, group, per_channel in MODELS[::2] if quick else MODELS:
        io = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
              "out_ptr": "*bf16", "gcum_ptr": "*fp32", "w_ptr": "*bf16", "u_ptr": "*bf16", "aqk_ptr": "*fp32",
              "scale": "fp32", **INTS}
        yield (f"gdn chunk prepare {label}", _chunk_prepare_kernel, io,
               dict(GROUP=group, DV_P=128, CHUNK_SIZE=64, PER_CHANNEL=per_channel, NORM=True, UPCAST=False, IEEE=False,
                    **heads), PREPARE_WARPS, 1)
        for state in ("fp32",) if quick else ("fp32", "bf16"):
            types = dict(io, state_ptr=f"*{state}")
            yield (f"gdn chunk scan {label} state={state}", _chunk_scan_kernel, types,
                   dict(GROUP=group, BV=CHUNK_BLOCK_V, CHUNK_SIZE=64, PER_CHANNEL=per_channel, NORM=True,
                        HAS_CHECKPOINTS=True, UPCAST=False, IEEE=False, **heads), SCAN_WARPS, 2)
            for block_v in (16, MAX_BLOCK_V):
                yield (f"gdn recurrent {label} state={state} BV={block_v}", _recurrent_kernel, types,
                       dict(GROUP=group, BV=block_v, PER_CHANNEL=per_channel, NORM=True, HAS_CHECKPOINTS=True, **heads),
                       recurrent_warps(block_v, 4 if state == "fp32" else 2), 1)
    conv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*bf16", "out_ptr": "*bf16", **INTS}
    update_c, update_warps = UPDATE_TILE
    for outputs in (True, False):
        yield (f"conv1d update K=4 {'(decode, verification)' if outputs else '(window store)'}", _conv_update_kernel, conv,
               dict(WIDTH=4, BLOCK_C=update_c, HAS_BIAS=False, SILU=True, COMPUTE_OUT=outputs, HAS_CHECKPOINTS=outputs),
               update_warps, 1)
    block_t, block_c, warps = PREFILL_TILE
    yield ("conv1d prefill K=4", _conv_prefill_kernel, conv,
           dict(WIDTH=4, BLOCK_T=block_t, BLOCK_C=block_c, HAS_BIAS=False, SILU=True, HAS_CHECKPOINTS=True), warps, 1)

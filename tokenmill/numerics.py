"""Number formats every room shares (a leaf module: of tokenmill it imports only `errors`).

The low-precision element and scale formats of quantized checkpoints, each with the one rule
that encodes it and the one that decodes it, so a checkpoint writer and every reader agree bit
for bit:

- FP8 E4M3 (torch.float8_e4m3fn): elements of FP8 and MXFP8 weights, NVFP4's block scales.
- E8M0: a power-of-two scale stored as its biased exponent in a uint8 (MX formats): 2^(e - 127).
- E2M1 (FP4): NVFP4's elements, sign bit 3 + magnitude index bits 0-2, two per byte along K
  with element 2i in the low nibble.
- NVFP4: E2M1 elements, one E4M3 scale per NVFP4_GROUP of them along K and a float32 global
  scale over them (per tensor; per output row once fused shards are stacked):
  x = e2m1 * scale * global, in that order in float32 (`quantize_nvfp4`, `dequantize_nvfp4`).
"""

from __future__ import annotations

import torch

from tokenmill.errors import ConfigError

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_E4M3).max
"""The largest finite E4M3 value (448): quantizers saturate here."""

E8M0_BIAS = 127
E8M0_NAN = 255
MX_GROUP = 32
"""Elements along K that share one E8M0 scale in the MX formats."""

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the eight E2M1 codes 0-7 (code | 8 is the negative)."""
# Midpoints between neighbouring magnitudes; a tie rounds to the even code, so the midpoints
# below an even code (0.75, 1.75, 3.5) round up and the others down.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (False, True, False, True, False, True, False)

NVFP4_GROUP = 16
"""Elements along K that share one E4M3 scale in NVFP4."""
NVFP4_SCALE_MIN = 2.0**-9
"""The smallest E4M3 value above zero (a subnormal): NVFP4 block scales are clamped to it."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": FP8_E4M3}
"""KV-cache dtypes by their flag name besides auto (the model's dtype)."""

STATE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Recurrent-state (SSM / delta-rule) dtypes by their flag name besides auto."""


def recurrent_state_dtype(flag: str, checkpoint_hint: str | None) -> torch.dtype:
    """--mamba-ssm-cache-dtype: a named dtype, or auto = the checkpoint's `mamba_ssm_dtype`,
    else float32 (the precision the models were trained with)."""
    name = (checkpoint_hint or "float32") if flag == "auto" else flag
    if name not in STATE_DTYPES:
        raise ConfigError(f"the checkpoint's mamba_ssm_dtype {name!r} is not one of {', '.join(STATE_DTYPES)}; "
                          "choose one with --mamba-ssm-cache-dtype")
    return STATE_DTYPES[name]


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in float32, saturated at +-448, rounded to E4M3 (nearest, ties to even)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def e8m0_exponent(amax: torch.Tensor, element_max: float = FP8_E4M3_MAX) -> torch.Tensor:
    """The E8M0 code (uint8) of the smallest power-of-two scale that keeps amax / scale within
    element_max: 2^ceil(log2(amax / element_max)), the exponent clamped to [-127, 127] (an
    all-zero group gets 2^-127)."""
    exponent = torch.ceil(torch.log2(amax.float() / element_max)).nan_to_num(neginf=-E8M0_BIAS)
    return (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (code 255 is NaN)."""
    value = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes.to(torch.int32) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.nan, value)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """x (already scaled into +-6, larger magnitudes saturate) as E2M1 codes 0-15 in a uint8:
    nearest magnitude, ties to the even code; -0.0 keeps its sign bit."""
    magnitude = x.float().abs()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIES_UP):
        code += (magnitude >= midpoint if tie_up else magnitude > midpoint).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0-15 (uint8) as float32."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0-15 -> [..., K / 2] bytes, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing two codes per byte needs an even last dimension, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] bytes -> [..., K] codes 0-15 (the low nibble first)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


ScaleBlock = tuple[int, int]
"""(rows, columns) of a weight that share one scale; columns 0 = the whole row. A weight
[..., N, K] with blocks (r, c) has scales [..., ceil(N / r), ceil(K / c)] (c = 0: [..., ceil(N / r), 1])."""


def scale_grid_shape(n: int, k: int, block: ScaleBlock) -> tuple[int, int]:
    rows, cols = block
    return -(-n // rows), (-(-k // cols) if cols else 1)


def scales_as_float(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: uint8 scales are E8M0 codes, anything else is taken as it is."""
    return e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock) -> torch.Tensor:
    """weight [..., N, K] (FP8 E4M3) times its block scales [..., ceil(N / r), ceil(K / c)] (float32,
    or uint8 E8M0 codes), as float32 [..., N, K]."""
    n, k = weight.shape[-2:]
    rows, cols = block
    factors = scales_as_float(scale).repeat_interleave(rows, dim=-2)[..., :n, :]
    factors = factors.repeat_interleave(cols, dim=-1)[..., :k] if cols else factors
    return weight.float() * factors


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The global scale that maps amax to the largest NVFP4 value, 6 * 448: amax / 2688 (1.0
    for all-zero values)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / (E2M1_MAX * FP8_E4M3_MAX), torch.ones_like(amax))


def nvfp4_block_scale(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale of NVFP4 groups whose largest |x| is `amax`: amax / (6 * global) clamped to
    [2^-9, 448], rounded to E4M3."""
    return (amax.float() / (E2M1_MAX * global_scale.float())).clamp(NVFP4_SCALE_MIN, FP8_E4M3_MAX).to(FP8_E4M3)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor,
                   scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of NVFP4_GROUP) -> (packed E2M1 codes uint8 [..., K / 2], E4M3
    scales [..., K / 16]) under global_scale (float32, broadcast over the rows: 0-d or [..., 1]):
    each group's scale is nvfp4_block_scale of its amax (or the given `scale`, as GPTQ fixed it),
    each element x / (scale * global) rounded to E2M1 (nearest, ties to even, saturating)."""
    if x.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 takes whole groups of {NVFP4_GROUP} along the last dimension, got {x.shape[-1]}")
    groups = x.float().unflatten(-1, (-1, NVFP4_GROUP))
    g = global_scale.float()[..., None]
    if scale is None:
        scale = nvfp4_block_scale(groups.abs().amax(dim=-1), g[..., 0])
    codes = e2m1_encode(groups / (scale.float()[..., None] * g))
    return pack_nibbles(codes.flatten(-2)), scale


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """packed codes [..., K / 2], E4M3 scales [..., K / 16] and a float32 global scale (0-d, or
    [..., N, 1] per row) -> float32 [..., K]: (e2m1 * scale) * global."""
    values = e2m1_decode(unpack_nibbles(packed))
    return values * scale.float().repeat_interleave(NVFP4_GROUP, dim=-1) * global_scale

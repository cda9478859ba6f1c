"""Number formats every room shares (a leaf module: it imports nothing of tokenmill's)."""

from __future__ import annotations

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_E4M3).max
"""The largest finite E4M3 value (448): quantizers saturate here."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": FP8_E4M3}
"""KV-cache dtypes by their flag name besides auto (the model's dtype)."""

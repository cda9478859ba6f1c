"""Number formats every room shares (a leaf module: of tokenmill it imports only `errors`)."""

from __future__ import annotations

import torch

from tokenmill.errors import ConfigError

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_E4M3).max
"""The largest finite E4M3 value (448): quantizers saturate here."""

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

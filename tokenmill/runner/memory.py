"""How many KV blocks fit: from a byte budget, or from a profile of the GPU's memory; and whether a
model's weights fit at all, checked before they are allocated."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
# Kept free beside the profiled peak for CUDA-graph pools and allocator fragmentation.
GPU_HEADROOM_BYTES = 512 << 20
GIB = 2**30


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device; None elsewhere (no limit is checked)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def check_weights_fit(weight_bytes: Callable[[], int], config: EngineConfig, device: torch.device,
                      what: str = "the model", kv_cache_bytes: int | None = None) -> None:
    """Refuse, before allocating them, weights that cannot fit beside what the device already holds
    in its gpu_memory_utilization share (and an explicit KV cache size). weight_bytes is called only
    where the device's memory is known (sizing a model constructs it on the meta device)."""
    memory = device_memory(device)
    if memory is None:
        return
    free, total = memory
    weights = weight_bytes()
    utilization = config.cache.gpu_memory_utilization
    in_use = total - free
    usable = int(total * utilization) - in_use - GPU_HEADROOM_BYTES
    need = weights + (kv_cache_bytes or 0)
    if need <= usable:
        return
    kv = f" and {kv_cache_bytes / GIB:.2f} GiB of KV cache (--kv-cache-bytes)" if kv_cache_bytes else ""
    raise ConfigError(
        f"{what} does not fit: its weights need {weights / GIB:.2f} GiB ({weights:,} bytes){kv}, but "
        f"{max(usable, 0) / GIB:.2f} GiB of the device's {total / GIB:.2f} GiB are usable ({in_use / GIB:.2f} GiB in "
        f"use, --gpu-memory-utilization {utilization}, {GPU_HEADROOM_BYTES / GIB:.1f} GiB headroom); use a smaller or "
        "quantized model, another device, or raise --gpu-memory-utilization"
    )


def kv_cache_budget(config: EngineConfig, device: torch.device, profile_step: Callable[[], int], weight_bytes: int) -> int:
    """Bytes for the KV cache. On CUDA without --kv-cache-bytes: run the largest step once and
    give the KV cache what is left of gpu_memory_utilization x total memory (profile_step returns
    the bytes of the scratch caches it ran over, which are not counted in its peak)."""
    if config.cache.kv_cache_bytes is not None:
        return config.cache.kv_cache_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    try:
        scratch = profile_step()
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError as error:
        sched = config.scheduler
        raise ConfigError(
            f"the largest step does not fit in GPU memory beside the weights ({weight_bytes / GIB:.2f} GiB): "
            f"{max(sched.max_num_batched_tokens, sched.long_prefill_batched_tokens or 0)} tokens with keys up to "
            f"--max-model-len {config.model.max_model_len} ({error}); lower --max-num-batched-tokens "
            "(--long-prefill-batched-tokens) or --max-model-len, or raise --gpu-memory-utilization"
        ) from None
    peak = torch.cuda.max_memory_allocated(device) - scratch
    torch.cuda.empty_cache()
    logger.info(
        "memory profile: %.2f GiB total, %.2f GiB peak of weights (%.2f GiB) + activations, %.2f GiB outside torch",
        total / GIB, peak / GIB, weight_bytes / GIB, outside_torch / GIB,
    )
    return budget_after_profile(total, peak, outside_torch, weight_bytes, config.cache.gpu_memory_utilization)


def budget_after_profile(total: int, peak: int, outside_torch: int, weight_bytes: int, utilization: float) -> int:
    """The KV cache's share of utilization x total once the profiled peak (weights + the largest
    step's activations) and memory outside torch are taken; refuses a budget of nothing."""
    budget = int(total * utilization) - peak - outside_torch - GPU_HEADROOM_BYTES
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory is left for the KV cache: the weights take {weight_bytes / GIB:.2f} GiB "
            f"({weight_bytes:,} bytes), the largest step peaks at {peak / GIB:.2f} GiB with them, "
            f"{outside_torch / GIB:.2f} GiB are outside torch, of {total / GIB:.2f} GiB x {utilization}; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller or quantized model"
        )
    return budget

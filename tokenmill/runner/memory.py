"""How many KV blocks fit: from a byte budget, or from a profile of the GPU's memory."""

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


def kv_cache_budget(config: EngineConfig, device: torch.device, profile_step: Callable[[], None]) -> int:
    """Bytes for the KV cache. On CUDA without --kv-cache-bytes: run the largest step once and
    give the KV cache what is left of gpu_memory_utilization x total memory."""
    if config.cache.kv_cache_bytes is not None:
        return config.cache.kv_cache_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    budget = int(total * config.cache.gpu_memory_utilization) - peak - outside_torch - GPU_HEADROOM_BYTES
    logger.info(
        "memory profile: %.2f GiB total, %.2f GiB peak of weights + activations, %.2f GiB outside torch",
        total / 2**30, peak / 2**30, outside_torch / 2**30,
    )
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory is left for the KV cache (peak use {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB); raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return budget


def plan_num_blocks(budget: int, bytes_per_block: int, block_size: int, max_model_len: int) -> int:
    num_blocks = budget // bytes_per_block
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens but --max-model-len is {max_model_len}: one request "
            "could never fit; raise --kv-cache-bytes / --gpu-memory-utilization or lower --max-model-len"
        )
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB)", num_blocks, block_size, capacity,
                num_blocks * bytes_per_block / 2**30)
    return num_blocks

"""The reference attention backend: plain PyTorch over the paged cache, on CPU or CUDA.

Slow (a loop over requests) and obviously correct; every faster backend is tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_kv_heads, head_dim = k.shape[1:]
    if kv_cache.dtype == FP8:
        k = (k.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        v = (v.float() / v_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # Copies go through same-width integer views: index_copy_ has no FP8 kernel on every device.
    cache, k, v = _as_int(kv_cache), _as_int(k.to(kv_cache.dtype)), _as_int(v.to(kv_cache.dtype))
    cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one request, as [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    cache = _as_int(kv_cache)
    k = cache[0, blocks].flatten(0, 1)[:seq_len].view(kv_cache.dtype)
    v = cache[1, blocks].flatten(0, 1)[:seq_len].view(kv_cache.dtype)
    return k, v


# Most attention scores (query rows x keys x heads) one call materialises: a long prompt's queries
# go in blocks of rows, so an 8k-token prompt takes 128 MiB of scores, not 5 GiB.
MAX_SCORES = 1 << 25


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, causal: bool = True, window: int = 0) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping, k_scale, v_scale)
        return self.attend(q, kv_cache, metadata, scale, k_scale, v_scale, causal, window)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        write_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
               k_scale: float = 1.0, v_scale: float = 1.0, causal: bool = True, window: int = 0) -> torch.Tensor:
        out = torch.empty_like(q)
        num_heads = q.shape[1]
        group = num_heads // kv_cache.shape[3]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
            keys, values = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            keys = (keys.to(q.dtype) * k_scale).repeat_interleave(group, dim=1)
            values = (values.to(q.dtype) * v_scale).repeat_interleave(group, dim=1)
            rows = max(1, MAX_SCORES // (seq_len * num_heads))
            for first in range(0, q_len, rows):
                last = min(q_len, first + rows)
                # Query j sits at position seq_len - q_len + j and sees keys 0..that position (all
                # seq_len keys when not causal); with a window, none below position - window + 1.
                end = seq_len - q_len + last if causal else seq_len  # keys the chunk's last row sees
                rows_at = torch.arange(seq_len - q_len + first, seq_len - q_len + last, device=q.device)[:, None]
                keys_at = torch.arange(end, device=q.device)[None, :]
                mask = keys_at <= (rows_at if causal else torch.full_like(rows_at, seq_len - 1))
                if window > 0:
                    mask &= keys_at > rows_at - window
                out[start + first : start + last] = F.scaled_dot_product_attention(
                    q[start + first : start + last].transpose(0, 1),
                    keys[:end].transpose(0, 1),
                    values[:end].transpose(0, 1),
                    attn_mask=mask,
                    scale=scale,
                ).transpose(0, 1)
            start += q_len
        return out

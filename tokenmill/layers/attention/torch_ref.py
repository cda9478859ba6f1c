"""The reference attention backend: plain PyTorch over the paged cache, on CPU or CUDA.

Slow (a loop over requests) and obviously correct; every faster backend is tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values of one request, as [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_host, metadata.seq_lens_host)):
            keys, values = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            keys = keys.to(q.dtype).repeat_interleave(group, dim=1)
            values = values.to(q.dtype).repeat_interleave(group, dim=1)
            # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            out[start : start + q_len] = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
            ).transpose(0, 1)
            start += q_len
        return out

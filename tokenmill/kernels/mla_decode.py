"""Host side of absorbed MLA attention (decode and verification): pick the tile shape and the
split count from host-known sizes, then launch (`absorbed_attention`). Nothing here reads device
memory, so a launch is graph-safe: a plan made from overstated host lengths (a captured graph's
maximum) stays correct, since each program clips its KV range to its request's true length.

Tile shapes are leads for an H200 (sm_90); benchmarks/mla_bench.py times the alternatives. On
CPU (TRITON_INTERPRET=1) tiles are small so tiny tests cross pages, head tiles and splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels._common import FP8_DTYPE, dot_width, interpreting, next_pow2, sm_count
from tokenmill.kernels.mla_absorbed import _merge_kernel, _mla_absorbed_kernel
from tokenmill.kernels.paged_attention import LOG2E

MAX_SPLITS = 256
# Split until the grid has about this many programs per multiprocessor: a program streams its
# share of the latent cache, and at batch 1 nothing else fills the machine.
WAVES = 2
# Fewest keys of the longest request per split: each split also writes a float32 partial
# output of rows x kv_lora_rank, which must stay small beside the latent bytes it reads.
MIN_SPLIT_KEYS = 256
# Rows (query tokens x heads) per program on a GPU: one tensor-core tile of queries; more would
# hold rows x kv_lora_rank float32 accumulators beyond the register file.
MAX_ROWS = 64
MERGE_TILE = 4096  # splits x latent columns one merge program holds


@dataclass(frozen=True)
class AbsorbedPlan:
    block_h: int  # heads per program
    block_q: int  # query tokens per program; 1 = the decode layout
    block_n: int  # latent rows (keys) per KV tile
    num_splits: int  # KV splits per query tile (1: no merge pass)
    min_split_tiles: int  # fewest KV tiles a split takes on device; later splits may be empty
    num_warps: int
    num_stages: int
    num_tiles: int  # grid size along the query-tile axis
    head_tiles: int  # grid size along the head axis

    @property
    def block_m(self) -> int:
        return self.block_q * self.block_h

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def _key_tile(block_m: int, cache_bytes: int) -> int:
    """Latent rows per KV tile: the H200 sweep's best at 32k for a 16-row decode tile (benchmarks/RESULTS.md),
    128 rows of a 2-byte cache or 64 of FP8, two stages of which fit shared memory beside the
    queries; larger query tiles (verification, 128 heads) and float32 caches keep 32."""
    if block_m > 16 or cache_bytes > 2:
        return 32
    return 128 if cache_bytes == 2 else 64


def plan_absorbed(
    *,
    num_tokens: int,
    num_requests: int,
    max_query_len: int,
    max_seq_len: int,
    num_heads: int,
    device: torch.device,
    fp8_cache: bool = False,
    cache_bytes: int | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    min_split_tokens: int | None = None,
) -> AbsorbedPlan:
    """Choose the launch; every keyword left None is chosen here. Splits are added while the grid
    is short of WAVES programs per multiprocessor and each keeps at least `min_split_tokens` keys
    of the longest request."""
    on_gpu = device.type == "cuda" and not interpreting()
    max_rows = MAX_ROWS if on_gpu else 8
    if block_h is None:
        block_h = min(next_pow2(num_heads), max_rows)
    if block_q is None:
        block_q = max(1, min(next_pow2(max_query_len), max_rows // block_h))
    block_m = block_q * block_h
    if block_n is None:
        block_n = _key_tile(block_m, 1 if fp8_cache else cache_bytes or 2) if on_gpu else 8
    head_tiles = -(-num_heads // block_h)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_requests
    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_KEYS if on_gpu else 2 * block_n
    if num_splits is None:
        wanted = -(-WAVES * sm_count(device) // (num_tiles * head_tiles))
        by_length = -(-max_seq_len // min_split_tokens)
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    min_split_tiles = max(1, min_split_tokens // block_n)
    # 8 warps keep a 16-row decode tile's accumulators and widened FP8 tile out of local memory.
    num_warps = 8 if on_gpu else 4
    num_stages = (2 if block_m >= 64 or fp8_cache or block_n >= 64 else 3) if on_gpu else 1
    return AbsorbedPlan(block_h, block_q, block_n, num_splits, min_split_tiles, num_warps, num_stages, num_tiles, head_tiles)


def absorbed_attention(
    q_latent: torch.Tensor,  # [T, H, kv_lora_rank], unit stride along the last dim
    q_pe: torch.Tensor,  # [T, H, rope_dim], rotated, unit stride along the last dim
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim], model dtype or FP8
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    softmax_scale: float,
    plan: AbsorbedPlan,
    cache_scale: float = 1.0,
    out: torch.Tensor | None = None,  # [T, H, kv_lora_rank], any token/head strides
) -> torch.Tensor:
    """Causal MQA of absorbed queries over their requests' cached latents (which must already hold
    this step's tokens). cache_scale applies to an FP8 cache only, as in mla_ref. Rows of `out`
    outside every request are left as they are."""
    num_tokens, num_heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[2]
    if cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(f"a latent cache row holds {cache.shape[2]} values, not {latent_dim} + {rope_dim}")
    if out is None:
        out = torch.empty_like(q_latent)
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    if q_latent.stride(2) != 1 or q_pe.stride(2) != 1 or cache.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("absorbed_attention needs a unit stride along the last dimension")
    if cache.dtype != FP8_DTYPE:
        cache_scale = 1.0
    splits = plan.num_splits
    if plan.split:
        part_out = torch.empty((num_tokens, num_heads, splits, latent_dim), dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q_latent.device)
    else:
        part_out = part_lse = out  # unused
    _mla_absorbed_kernel[(plan.num_tiles, plan.head_tiles, splits)](
        out, part_out, part_lse,
        q_latent, q_pe, cache,
        block_tables, seq_lens, query_start_loc,
        num_requests, num_heads, splits, softmax_scale * cache_scale * LOG2E, cache_scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        LATENT=latent_dim, ROPE=rope_dim, LATENT_P=dot_width(latent_dim), ROPE_P=dot_width(rope_dim),
        BLOCK_H=plan.block_h, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, PAGE=cache.shape[1],
        SPLIT=plan.split, MIN_SPLIT_TILES=plan.min_split_tiles,
        UPCAST=interpreting() and q_latent.dtype == torch.bfloat16, IEEE=q_latent.dtype == torch.float32,
        F16_DOT=cache.dtype == FP8_DTYPE and q_latent.dtype == torch.bfloat16,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.split:
        splits_p = next_pow2(splits)
        block_d = min(next_pow2(latent_dim), max(16, MERGE_TILE // splits_p))
        _merge_kernel[(num_tokens, num_heads, -(-latent_dim // block_d))](
            out, part_out, part_lse, query_start_loc, num_requests, num_heads, splits, out.stride(0), out.stride(1),
            LATENT=latent_dim, BLOCK_D=block_d, SPLITS_P=splits_p, num_warps=4,
        )
    return out

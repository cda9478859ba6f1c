"""Host side of paged attention: pick tile shapes and the KV split count from host-known sizes,
then launch (`paged_attention`). Nothing here reads device memory, so a launch is graph-safe.

Tile shapes are leads for an H200 (sm_90); the benchmark in benchmarks/attention_bench.py is
where they are checked. On CPU (TRITON_INTERPRET=1) tiles are small so tiny tests cross many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels._common import FP8_DTYPE, dependent_launch, interpreting, next_pow2, sm_count
from tokenmill.kernels.paged_attention import LOG2E, _merge_kernel, _paged_attention_kernel

MAX_SPLITS = 64
# Split until the grid has about this many programs per multiprocessor: decode programs are
# short and memory-bound (several per SM hide latency and balance the tail); a prefill tile
# already carries plenty of work, so it is split only to fill the machine once.
DECODE_WAVES = 4
PREFILL_WAVES = 1
SHORT_DECODE_KEYS = 256
# Fewest keys of the longest request per split on a GPU, once it has more than
# SHORT_DECODE_KEYS (up to those, one program per head streams them all: the short sweep). At
# batch 1 a split is a chain of dependent memory round trips, one per tile, so one tile of keys
# per split beats longer splits there and costs nothing at larger batches (benchmarks/RESULTS.md).
MIN_SPLIT_KEYS = 64
# A prompt chunk at depth whose grid already fills the machine is still split along the keys when
# that evens out its last wave: each program of a deep chunk streams the same long key range, so
# 200 programs on 132 multiprocessors take two full rounds, and 7 splits of 1,400 programs take
# 11 / 7 = 1.57. Splits keep at least PREFILL_SPLIT_KEYS keys each, their float32 partial outputs
# at most PREFILL_PARTIAL_BYTES (inside the memory profile's headroom), and are taken only when
# the rounds they save are worth a merge pass (PREFILL_SPLIT_GAIN).
PREFILL_SPLIT_KEYS = 16384
PREFILL_MAX_SPLITS = 8
PREFILL_PARTIAL_BYTES = 256 << 20
PREFILL_SPLIT_GAIN = 0.9
DEEP_CHUNK_ROWS = 64  # a prompt chunk; verify steps (1 + drafts rows) keep the decode rule
# A prompt chunk over at least this many keys (head size 128, on a GPU) takes the deep tiles
# below, from the pp2048-at-100k sweep in benchmarks/attention_bench.py --deep-prefill-sweep:
# bf16 keys stream best under 256 rows of 8 warps, FP8 keys (widened per tile, so bound by
# instructions) under 128 rows of 4 warps; both four stages deep.
DEEP_TILE_KEYS = 16384
DEEP_TILES = {False: (256, 64, 8, 4), True: (128, 64, 4, 4)}  # fp8 K/V -> (rows, keys, warps, stages)


@dataclass(frozen=True)
class AttentionPlan:
    block_q: int  # query tokens per program; 1 = the decode layout
    block_m: int  # rows per program: block_q * next_pow2(group), at least 16
    block_n: int  # keys per KV tile
    num_splits: int  # KV splits per query tile (1: no merge pass)
    min_split_tiles: int  # fewest KV tiles a split takes on device; later splits may be empty
    num_warps: int
    num_stages: int
    num_tiles: int  # grid size along the query-tile axis

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def plan_attention(
    *,
    num_tokens: int,
    num_requests: int,
    max_query_len: int,
    max_seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> AttentionPlan:
    """Choose the launch for a cache of `kv_dtype` (FP8 tiles differ; the deep tiles' four stages
    fit in shared memory at 1 or 2 bytes an element). `num_splits` forces the split count; otherwise
    splits are added while the grid is short of the waves above and each split keeps at least `min_split_tokens` keys
    of the longest request (on a GPU, no split up to SHORT_DECODE_KEYS keys). On device a split
    also takes at least `min_split_tokens` keys of its own request, so a plan made for long
    requests (a captured graph) wastes little on short ones."""
    on_gpu = device.type == "cuda" and not interpreting()
    group_p = next_pow2(num_heads // num_kv_heads)
    big_head = head_dim > 128
    block_n = (32 if big_head else 64) if on_gpu else 16
    max_splits = MAX_SPLITS
    fp8_kv = kv_dtype == FP8_DTYPE
    deep_tiles = (on_gpu and head_dim == 128 and kv_dtype.itemsize <= 2
                  and max_query_len >= DEEP_CHUNK_ROWS and max_seq_len >= DEEP_TILE_KEYS)
    if max_query_len <= 1:
        block_q = 1
        # From the batch-1 long-context sweep (benchmarks/attention_bench.py): bf16 is fastest with
        # 64-key tiles double-buffered; FP8 tiles are half the bytes, so 128 keys per tile and half
        # the splits keep each program's stream as long.
        num_warps, num_stages = 4, 2
        if fp8_kv and on_gpu and not big_head:
            block_n, num_stages, max_splits = 128, 3, MAX_SPLITS // 2
        elif on_gpu and not big_head and num_requests == 1 and max_seq_len <= SHORT_DECODE_KEYS:
            # Batch 1 over few keys (attention_bench.py --short-sweep; figures in benchmarks/RESULTS.md):
            # a step is a chain of memory round trips, and 128-key tiles make the chain shorter.
            block_n = 128
    else:
        target_rows = (64 if big_head else 128) if on_gpu else 32
        num_warps, num_stages = (8 if head_dim >= 128 else 4), (2 if big_head else 3)
        if deep_tiles:
            target_rows, block_n, num_warps, num_stages = DEEP_TILES[fp8_kv]
        block_q = max(1, min(target_rows // group_p, next_pow2(max_query_len)))
    block_m = max(16, block_q * group_p)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_requests

    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_KEYS if on_gpu else 2 * block_n
    programs = num_tiles * num_kv_heads
    partial_bytes = num_tokens * num_heads * head_dim * 4
    if num_splits is None and deep_tiles:
        num_splits = deep_prefill_splits(programs, sm_count(device), max_seq_len, partial_bytes)
    elif num_splits is None:
        waves = DECODE_WAVES if block_q == 1 else PREFILL_WAVES
        wanted = -(-waves * sm_count(device) // programs)
        by_length = 1 if on_gpu and max_seq_len <= SHORT_DECODE_KEYS else -(-max_seq_len // min_split_tokens)
        num_splits = max(1, min(wanted, by_length, max_splits))
        if max_query_len >= DEEP_CHUNK_ROWS and num_splits == 1:
            num_splits = deep_prefill_splits(programs, sm_count(device), max_seq_len, partial_bytes)
    min_split_tiles = max(1, min_split_tokens // block_n)
    return AttentionPlan(block_q, block_m, block_n, num_splits, min_split_tiles, num_warps, num_stages, num_tiles)


def deep_prefill_splits(programs: int, slots: int, max_seq_len: int, partial_bytes_per_split: int) -> int:
    """Splits along the keys for a prompt chunk of `programs` on `slots` (the multiprocessors):
    the count that most evens out the rounds of programs (a grid short of the slots fills them; a
    grid past them evens out its last round), among those that keep PREFILL_SPLIT_KEYS keys and
    PREFILL_PARTIAL_BYTES of partials, if it saves enough."""
    def rounds(k: int) -> float:  # time in units of one unsplit program's run
        return -(-k * programs // slots) / k

    limit = min(PREFILL_MAX_SPLITS, max_seq_len // PREFILL_SPLIT_KEYS, PREFILL_PARTIAL_BYTES // partial_bytes_per_split)
    best = min(range(1, max(1, limit) + 1), key=lambda k: (rounds(k), k))
    return best if rounds(best) <= PREFILL_SPLIT_GAIN * rounds(1) else 1


def paged_attention(
    q: torch.Tensor,  # [T, H, D], unit stride along D
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], model dtype or float8_e4m3fn
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    plan: AttentionPlan,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    causal: bool = True,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of packed queries over their requests' cached keys and values (which
    must already hold this step's tokens); causal=False: every query of a request sees all its
    seq_len keys (a block drafter's block); window > 0: row r at position p also sees no key
    below p - window + 1 (sliding-window layers). Rows of `out` outside every request are left as is."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(q)
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    if q.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("paged_attention needs a unit stride along head_dim")
    group = num_heads // num_kv_heads
    block_d = next_pow2(head_dim)
    upcast = interpreting() and q.dtype == torch.bfloat16
    ieee = q.dtype == torch.float32
    pdl = dependent_launch(q.device)
    splits = plan.num_splits
    part_out, part_lse = split_partials(out, splits)
    _paged_attention_kernel[(plan.num_tiles, num_kv_heads, splits)](
        out, part_out, part_lse,
        q, key_cache, value_cache,
        block_tables, seq_lens, query_start_loc,
        num_requests, num_heads, splits, scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P=next_pow2(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, PAGE=page,
        SPLIT=plan.split, MIN_SPLIT_TILES=plan.min_split_tiles, UPCAST=upcast, IEEE=ieee,
        F16_DOT=key_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16, LAUNCH_NEXT=pdl, CAUSAL=causal, WINDOW=window,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    merge_partials(out, part_out, part_lse, query_start_loc, num_requests, splits, pdl)
    return out


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs [T, H, splits, D], their log2-sum-exp [T, H, splits]) of a split launch
    writing `out` [T, H, D] (`out` itself, unused, without splits)."""
    if splits == 1:
        return out, out
    num_tokens, num_heads, head_dim = out.shape
    return (torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=out.device),
            torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=out.device))


def merge_partials(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, query_start_loc: torch.Tensor,
                   num_requests: int, splits: int, pdl: bool) -> None:
    """Combine a split launch's partial outputs into `out` (nothing to do without splits)."""
    if splits == 1:
        return
    num_tokens, num_heads, head_dim = out.shape
    _merge_kernel[(num_tokens, num_heads)](
        out, part_out, part_lse, query_start_loc, num_requests, num_heads, splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), SPLITS_P=next_pow2(splits), LAUNCH_NEXT=pdl,
        num_warps=4 if head_dim >= 128 else 2,
    )

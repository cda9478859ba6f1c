"""QSA decode (Qwen4Exp's indexed sparse attention) against dense paged attention at the same context.

    python benchmarks/qsa_bench.py [--index-heads 16] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/qsa_bench.py --smoke   # tiny, on CPU: checks the script

One attention layer's decode step at the Qwen4Exp attention shape (16 query heads, 2 KV heads of
256, 16-token pages shuffled as in a long-running pool), batch 1 and 16, contexts 4k / 32k / 128k,
bf16 and FP8 K/V. QSA = the block scores over the pooled index keys (one key of 128 per 4 tokens,
--index-heads heads) + torch.topk of the best 512 blocks (a 2048-token budget) + sparse attention
over them; dense = paged attention over the whole context. Reported: microseconds of each part,
QSA / dense, and the bytes each reads. The QSA attention part must stay flat from 4k to 128k (it
reads budget tokens); only the scores grow, at 1/4 of a token's index key per context token.

Every GPU time is a CUDA-graph replay after an L2 flush, median of the repeats. --smoke runs the
same code on CPU at toy sizes and checks the sparse kernel against the PyTorch reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from an uninstalled checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_bench import timer  # CUDA-graph replays after an L2 flush; wall time on CPU

from tokenmill.kernels.attention import paged_attention, plan_attention
from tokenmill.kernels.qsa_index import block_scores
from tokenmill.kernels.sparse_attention import plan_sparse, sparse_paged_attention
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.attention.qsa_ref import select_blocks, sparse_attention_ref

PAGE = 16
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Setup:
    device: str
    heads: int
    kv_heads: int
    head_dim: int
    index_heads: int
    index_dim: int
    ratio: int
    budget: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    repeats: int


FULL = Setup("cuda", 16, 2, 256, 16, 128, 4, 2048, (1, 16), (4096, 32768, 131072), 30)
SMOKE = Setup("cpu", 4, 2, 32, 4, 16, 4, 16, (1, 2), (24, 64), 1)


def decode_batch(s: Setup, batch: int, context: int) -> tuple[AttentionMetadata, int]:
    """One query token per request, each with `context` tokens in its own shuffled pages."""
    pages = -(-context // PAGE)
    order = torch.randperm(batch * pages, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=s.device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=s.device),
        block_tables=order.view(batch, pages).to(s.device),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=s.device),
        query_lens_host=[1] * batch,
        seq_lens_host=[context] * batch,
    )
    return metadata, batch * pages


def bench_case(s: Setup, batch: int, context: int, kv_dtype: torch.dtype, time_fn) -> dict:
    md, num_pages = decode_batch(s, batch, context)
    dev, topk = s.device, s.budget // s.ratio
    q = torch.randn(batch, s.heads, s.head_dim, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, num_pages, PAGE, s.kv_heads, s.head_dim, device=dev, dtype=torch.bfloat16).to(kv_dtype)
    q_index = torch.randn(batch, s.index_heads, s.index_dim, device=dev, dtype=torch.bfloat16)
    index_cache = torch.randn(num_pages, PAGE // s.ratio, s.index_dim, device=dev, dtype=torch.bfloat16)
    width, scale = context // s.ratio, s.head_dim**-0.5
    qsl, lens, tables = md.query_start_loc, md.seq_lens, md.block_tables
    sparse_plan = plan_sparse(num_tokens=batch, num_kv_heads=s.kv_heads, block_topk=topk, ratio=s.ratio,
                              head_dim=s.head_dim, device=torch.device(dev))
    dense_plan = plan_attention(num_tokens=batch, num_requests=batch, max_query_len=1, max_seq_len=context,
                                num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim, device=torch.device(dev),
                                kv_dtype=kv_dtype)
    blocks = select_blocks(block_scores(q_index, index_cache, qsl, lens, tables, s.ratio, width), topk)
    sparse_out = torch.empty_like(q)

    def index() -> None:
        select_blocks(block_scores(q_index, index_cache, qsl, lens, tables, s.ratio, width), topk)

    def sparse() -> None:
        sparse_paged_attention(q, kv[0], kv[1], blocks, qsl, lens, tables, s.ratio, scale, sparse_plan, out=sparse_out)

    def dense() -> None:
        paged_attention(q, kv[0], kv[1], qsl, lens, tables, scale, dense_plan)

    if s.device == "cpu":  # the script's own check: the kernel against the reference
        sparse()
        ref = sparse_attention_ref(q.float(), kv.float(), md, blocks, s.ratio, scale)
        assert torch.allclose(sparse_out.float(), ref, atol=3e-2, rtol=3e-2), "sparse attention disagrees with its reference"
    t_index, t_sparse, t_dense = time_fn(index), time_fn(sparse), time_fn(dense)
    kv_token_bytes = 2 * s.kv_heads * s.head_dim * kv.element_size()
    attended = min(context, s.budget + s.ratio - 1)
    return {
        "batch": batch, "context": context, "kv": "fp8" if kv_dtype == FP8 else "bf16",
        "index_us": t_index * 1e6, "sparse_us": t_sparse * 1e6, "qsa_us": (t_index + t_sparse) * 1e6,
        "dense_us": t_dense * 1e6, "qsa/dense": (t_index + t_sparse) / t_dense,
        "index_MB": batch * width * s.index_dim * 2 / 1e6, "sparse_MB": batch * attended * kv_token_bytes / 1e6,
        "dense_MB": batch * context * kv_token_bytes / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU (set TRITON_INTERPRET=1)")
    parser.add_argument("--index-heads", type=int, default=FULL.index_heads, help="QSA indexer query heads")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    s = SMOKE if args.smoke else Setup(**{**FULL.__dict__, "index_heads": args.index_heads})
    if s.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke on CPU with TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    time_fn = timer(s)
    rows = [bench_case(s, b, c, kv, time_fn) for kv in (torch.bfloat16, FP8) for b in s.batches for c in s.contexts]
    header = ("batch", "context", "kv", "index_us", "sparse_us", "qsa_us", "dense_us", "qsa/dense", "sparse_MB", "dense_MB")
    print(" ".join(f"{h:>10}" for h in header))
    for row in rows:
        print(" ".join(f"{row[h]:>10.3g}" if isinstance(row[h], float) else f"{row[h]:>10}" for h in header))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

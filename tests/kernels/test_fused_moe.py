"""The fused MoE kernels (few-row decode path, aligned grouped GEMMs, combine) against
fused_experts_ref: tiny shapes under the interpreter, Qwen3-30B-A3B's on CUDA (bf16)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import HAS_CUDA, on_cpu, on_gpu
from moe_cases import MOE_CASES, randomize_
from no_host_sync import forbid_host_reads

from tokenmill.kernels.moe import experts as experts_module
from tokenmill.kernels.moe.align import align_slots, align_slots_ref
from tokenmill.kernels.moe.combine import combine
from tokenmill.kernels.moe.experts import fused_experts
from tokenmill.kernels.moe.few_row import FEW_ROWS, few_row_experts
from tokenmill.kernels.moe.grouped_gemm import grouped_experts, grouped_tiles
from tokenmill.layers.moe import RoutingConfig, SparseMoeBlock, fused_experts_ref, select_experts_ref

TINY = dict(experts=8, top_k=2, hidden=32, inter=64)
QWEN3_30B = dict(experts=128, top_k=8, hidden=2048, inter=768)


def _layer(experts: int, top_k: int, hidden: int, inter: int, tokens: int, dtype: torch.dtype, device: str,
           skew: int = 0, seed: int = 0):
    """(x, w13, w2, topk_weights, topk_ids); skew > 0 routes every token to experts < skew."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:
        logits[:, skew:] -= 100
    weights, ids = select_experts_ref(logits, RoutingConfig(experts, top_k, renormalize=True))
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() and t is not weights else None)
                 for t in (x, w13, w2, weights, ids))


def _assert_matches_reference(out: torch.Tensor, x, w13, w2, weights, ids) -> None:
    expected = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    scale = expected.abs().max().item()
    tol = 2e-5 * scale if x.dtype == torch.float32 else 2e-2 * scale
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize(
    "shape,tokens,dtype,device",
    [on_cpu(TINY, t, torch.float32, id=f"tiny-T{t}") for t in (1, 3, 17, 70)]
    + [on_cpu(TINY, 5, torch.bfloat16, id="tiny-bf16-T5"), on_cpu(TINY, 20, torch.bfloat16, id="tiny-bf16-T20"),
       on_cpu(dict(experts=6, top_k=3, hidden=40, inter=24), 5, torch.float32, id="ragged-T5"),
       on_cpu(dict(experts=6, top_k=3, hidden=40, inter=24), 20, torch.float32, id="ragged-T20")]
    + [on_gpu(QWEN3_30B, t, torch.bfloat16, id=f"qwen3-30b-T{t}") for t in (1, 16, 64, 2048)],
)
def test_fused_experts_match_reference(shape: dict, tokens: int, dtype: torch.dtype, device: str) -> None:
    operands = _layer(**shape, tokens=tokens, dtype=dtype, device=device)
    _assert_matches_reference(fused_experts(*operands), *operands)


@pytest.mark.parametrize(
    "path,tokens,skew,device",
    [on_cpu("few_row", FEW_ROWS, 2, id="few-row-16-rows-per-expert"), on_cpu("few_row", 3, 0, id="few-row-T3"),
     on_cpu("grouped", 3, 0, id="grouped-T3"), on_cpu("grouped", 40, 2, id="grouped-runs-over-3-blocks"),
     on_gpu("few_row", FEW_ROWS, 3, id="few-row-qwen3-30b-skewed"),
     on_gpu("grouped", 512, 4, id="grouped-qwen3-30b-skewed")],
)
def test_each_path_off_its_usual_range(path: str, tokens: int, skew: int, device: str) -> None:
    """Both paths take any token count they are given (few-row: up to FEW_ROWS), with all the
    tokens on a few experts (full 16-row tiles, runs of many row blocks) or spread out."""
    shape = TINY if device == "cpu" else QWEN3_30B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, w13, w2, weights, ids = _layer(**shape, tokens=tokens, dtype=dtype, device=device, skew=skew)
    if path == "few_row":
        slot_out = few_row_experts(x, w13, w2, weights, ids)
    else:
        tiles = grouped_tiles(ids.numel(), w13.shape[0])
        layout = align_slots(ids, w13.shape[0], tiles[0].block_m)
        slot_out = grouped_experts(x, w13, w2, weights, layout, ids.shape[1], tiles)
    _assert_matches_reference(combine(slot_out, ids.shape[1]), x, w13, w2, weights, ids)


@pytest.mark.parametrize("tokens,path", [(FEW_ROWS, "few_row"), (FEW_ROWS + 1, "grouped")])
def test_path_is_chosen_by_token_count(tokens: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []

    def stub(name: str):
        return lambda x, w13, w2, weights, *rest, **options: taken.append(name) or torch.zeros(weights.numel(), x.shape[1])

    monkeypatch.setattr(experts_module, "few_row_experts", stub("few_row"))
    monkeypatch.setattr(experts_module, "grouped_experts", stub("grouped"))
    x, w13, w2, weights, ids = _layer(**TINY, tokens=tokens, dtype=torch.float32, device="cpu")
    fused_experts(x, w13, w2, weights, ids)
    assert taken == [path]


@pytest.mark.parametrize("tokens,block_m,device", [on_cpu(70, 16), on_cpu(3, 16), on_gpu(2048, 64), on_gpu(64, 16)])
def test_align_sorts_every_slot_into_its_experts_run(tokens: int, block_m: int, device: str) -> None:
    experts = 8 if device == "cpu" else 128
    ids = torch.randint(0, experts, (tokens, 2 if device == "cpu" else 8), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(0)).to(device)
    layout = align_slots(ids, experts, block_m)
    counts, starts = align_slots_ref(ids.cpu(), experts, block_m)
    assert torch.equal(layout.counts.cpu(), counts) and torch.equal(layout.starts.cpu(), starts)
    flat = ids.reshape(-1).cpu()
    placed = layout.sorted_slots.cpu()
    for e in range(experts):
        run = placed[starts[e]: starts[e] + counts[e]].long()
        assert sorted(run.tolist()) == torch.nonzero(flat == e).flatten().tolist()


def test_combine_adds_gated_addend() -> None:
    gen = torch.Generator().manual_seed(0)
    slot_out, addend, gate = (torch.randn(shape, generator=gen) for shape in ((12, 40), (4, 40), (4, 1)))
    expected = slot_out.view(4, 3, 40).sum(1) + torch.sigmoid(gate) * addend
    torch.testing.assert_close(combine(slot_out, 3, addend, gate), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(combine(slot_out, 3, addend), slot_out.view(4, 3, 40).sum(1) + addend, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case,tokens", [("qwen2_moe", 5), ("deepseek_v3", 24)])
def test_fused_block_matches_reference_block(case: str, tokens: int) -> None:
    """The whole block through the kernels (routing, experts, combine with the shared expert, the
    few-row Linear kernels) equals its reference path."""
    config = MOE_CASES[case].config
    reference, fused = SparseMoeBlock(config), SparseMoeBlock(config, use_triton=True)
    randomize_(reference, seed=5)
    fused.load_state_dict(reference.state_dict())
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)


def test_fused_experts_refuse_bad_operands() -> None:
    x, w13, w2, weights, ids = _layer(**TINY, tokens=3, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="topk_ids must be int32"):
        fused_experts(x, w13, w2, weights, ids.long())
    with pytest.raises(ValueError, match="w2 must be"):
        fused_experts(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        fused_experts(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        few_row_experts(*_layer(**TINY, tokens=FEW_ROWS + 1, dtype=torch.float32, device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("tokens", [1, FEW_ROWS, 300])
def test_fused_block_replays_in_a_cuda_graph_without_host_sync(case: str, tokens: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing, both expert paths and the shared expert inside a captured graph: no host read
    while capturing, and a replay on new inputs gives what an eager call gives."""
    config = MOE_CASES[case].config
    with torch.device("cuda"):
        block = SparseMoeBlock(config, use_triton=True)
    randomize_(block, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(tokens, config.hidden_size, device="cuda", generator=gen)
    with torch.no_grad():
        block(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with monkeypatch.context() as patch:
            forbid_host_reads(patch, "the fused MoE block")
            with torch.cuda.graph(graph):
                out = block(x)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.testing.assert_close(out, block(x), rtol=0, atol=0)

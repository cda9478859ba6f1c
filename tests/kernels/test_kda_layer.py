"""The KDA layer (Kimi-Linear's delta attention) on the Triton conv and gated-delta kernels (the
interpreter on CPU) against transformers' KimiLinearDeltaAttention over whole sequences, and
against the same layer on the PyTorch references step by step: two requests in one packed batch
through prefill chunks, a decode, and a 1 + 4 verification whose rows write checkpoint slots."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import on_cpu, on_gpu

from tokenmill.layers.linear_attention import KimiDeltaAttention, RecurrentBatch
from tokenmill.quantization import Unquantized

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                           reason="this transformers has no Kimi-Linear")

# Per step, (request, rows) in batch order; request 1's 1 + 4 rows in the last step checkpoint
# its state after each of the first four.
SCHEDULE = [[(0, 5), (1, 20)], [(0, 19), (1, 1)], [(0, 1), (1, 5)]]
LENGTHS = (25, 26)
SLOTS, CHECKPOINTS = (0, 1), (2, 3, 4, 5)


def layers(hidden: int, heads: int, head_dim: int, device: str) -> tuple[torch.nn.Module, KimiDeltaAttention, ...]:
    """transformers' layer with seeded weights, and ours (references, Triton) holding the same."""
    config = kimi.KimiLinearConfig(hidden_size=hidden, num_hidden_layers=1, rms_norm_eps=1e-6, pad_token_id=None,
                                   bos_token_id=None, eos_token_id=None, layer_types=["linear_attention"],
                                   linear_attn_config={"head_dim": head_dim, "num_heads": heads,
                                                       "short_conv_kernel_size": 4})
    theirs = kimi.KimiLinearDeltaAttention(config, 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            shift = {"forget_gate.A_log": -1.5, "forget_gate.dt_bias": -2.0, "o_norm.weight": 1.0}.get(name, 0.0)
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5) + shift)
    t = dict(theirs.named_parameters())
    state = {"qkv_proj.weight": torch.cat([t[f"{n}_proj.weight"] for n in "qkv"]),
             "fgb_proj.weight": torch.cat([t["forget_gate.f_a_proj.weight"], t["g_a_proj.weight"], t["b_proj.weight"]]),
             "f_b_proj.weight": t["forget_gate.f_b_proj.weight"], "g_b_proj.weight": t["g_b_proj.weight"],
             "conv1d.weight": t["conv1d.weight"], "dt_bias": t["forget_gate.dt_bias"],
             "A_log": t["forget_gate.A_log"].flatten(), "o_norm.weight": t["o_norm.weight"],
             "o_proj.weight": t["o_proj.weight"]}
    ours = []
    for use_triton in (False, True):
        layer = KimiDeltaAttention(hidden, heads, head_dim, 4, 1e-6, "kda", Unquantized(), state_dtype=torch.float32,
                                   use_triton=use_triton)
        layer.load_state_dict(state)
        layer.to(device)
        layer.bind_cache({s.name: torch.zeros(len(SLOTS) + len(CHECKPOINTS), *s.shape, dtype=s.dtype, device=device)
                          for s in layer.cache_spec().tensors})
        ours.append(layer)
    return theirs, *ours


def run_schedule(layer: KimiDeltaAttention, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = layer.o_proj.weight.device
    done = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for i, step in enumerate(SCHEDULE):
        rows = torch.cat([xs[r][done[r]: done[r] + n] for r, n in step]).to(device)
        starts = [0]
        for _, n in step:
            starts.append(starts[-1] + n)
        checkpoints = None
        if i == len(SCHEDULE) - 1:
            checkpoints = torch.tensor([-1] * step[0][1] + list(CHECKPOINTS) + [-1], device=device)
        batch = RecurrentBatch(torch.tensor([SLOTS[r] for r, _ in step], device=device),
                               torch.tensor(starts, dtype=torch.int32, device=device),
                               torch.tensor([done[r] > 0 for r, _ in step], device=device), checkpoints)
        out = layer(rows, batch)
        for (r, n), first in zip(step, starts):
            outs[r].append(out[first: first + n].cpu())
            done[r] += n
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("hidden,heads,head_dim,tolerance,device", [
    on_cpu(32, 2, 16, 1e-4, id="tiny-interpreter"),
    on_gpu(256, 4, 64, 1e-2, id="cuda"),  # float32 operands, TF32 products in the chunk kernels
])
def test_triton_layer_matches_transformers_and_the_references(hidden, heads, head_dim, tolerance, device) -> None:
    theirs, reference, triton = layers(hidden, heads, head_dim, device)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, hidden, generator=gen) for n in LENGTHS]
    with torch.no_grad():
        expected = [theirs(x[None])[0] for x in xs]
        ref_outs, triton_outs = run_schedule(reference, xs), run_schedule(triton, xs)
    for ref, ours, exp in zip(ref_outs, triton_outs, expected):
        scale = exp.abs().max()
        assert ((ref - exp).abs().max() / scale).item() < tolerance
        assert ((ours - exp).abs().max() / scale).item() < tolerance
    for name in ("conv_state", "delta_state"):  # request slots and every checkpoint slot
        a, b = getattr(reference, name).cpu(), getattr(triton, name).cpu()
        assert a[list(CHECKPOINTS)].abs().sum() > 0
        torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance / 10)

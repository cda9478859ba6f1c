"""Hyper-connections against transformers' Qwen4ExpTextGatedResidual (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from qwen4exp_cases import randomize_, tiny_config
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

from tokenmill.layers.hyper_connections import HyperConnection


@pytest.mark.parametrize("hc_count, lowrank", [(2, 8), (4, 5)])
@pytest.mark.parametrize("inject", [True, False], ids=["block", "final-mixer"])
def test_matches_transformers(hc_count: int, lowrank: int, inject: bool) -> None:
    config = tiny_config(hc_count=hc_count, hc_lowrank=lowrank)
    theirs = Qwen4ExpTextGatedResidual(config, use_combine=inject)
    randomize_(theirs, seed=hc_count)
    ours = HyperConnection(config.hidden_size, hc_count, lowrank, config.rms_norm_eps, inject=inject)
    ours.load_state_dict(theirs.state_dict())
    streams = torch.randn(2, 7, hc_count * config.hidden_size)
    block_output = torch.randn(2, 7, config.hidden_size)
    ref = theirs(streams)
    mixed, weights = ours.mix(streams.view(14, hc_count, -1))
    if not inject:
        assert weights is None
        torch.testing.assert_close(mixed, ref.view(14, -1), rtol=1e-5, atol=1e-6)
        return
    ref_mixed, ref_streams, ref_weights = ref
    torch.testing.assert_close(mixed, ref_mixed.view(14, -1), rtol=1e-5, atol=1e-6)
    after = HyperConnection.inject(streams.view(14, hc_count, -1), block_output.view(14, -1), weights)
    ref_after = ref_streams + (block_output.unsqueeze(-2) * ref_weights.unsqueeze(-1)).flatten(-2)
    torch.testing.assert_close(after.flatten(-2), ref_after.view(14, -1), rtol=1e-5, atol=1e-6)


def test_widen_copies_the_embedding_into_every_stream() -> None:
    hidden = torch.randn(5, 8)
    streams = HyperConnection.widen(hidden, 3)
    assert streams.shape == (5, 3, 8)
    torch.testing.assert_close(streams.flatten(-2), hidden.repeat(1, 3))


def test_around_wraps_any_block_as_mix_then_inject() -> None:
    """A block of any kind (here a plain linear map, no Qwen4Exp part) wrapped by a connection:
    its input is the mixed streams, its output injected with the connection's weights; a final
    mixer wraps nothing."""
    torch.manual_seed(0)
    hc = HyperConnection(8, 3, 4, 1e-6)
    for p in hc.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    block = torch.nn.Linear(8, 8)
    streams = torch.randn(5, 3, 8)
    mixed, weights = hc.mix(streams)
    torch.testing.assert_close(hc.around(streams, block), streams + block(mixed).unsqueeze(-2) * weights.unsqueeze(-1))
    with pytest.raises(ValueError, match="wraps no block"):
        HyperConnection(8, 3, 4, 1e-6, inject=False).around(streams, block)

"""Make any read of a tensor's value on the host raise: proof that a hot path never synchronises."""

from __future__ import annotations

import pytest
import torch

HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__array__")


def forbid_host_reads(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    def boom(*args, **kwargs):
        raise AssertionError(f"host synchronisation inside {where}")

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    monkeypatch.setattr(torch, "argwhere", boom)

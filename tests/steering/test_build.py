"""`tokenmill steer build`: the shipped prompt sets and their splits; on the real SmolLM2 (slow), a
small build end to end: the post-instruction positions, a direction the engine then serves, and
the metadata the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.steering.prompts import read_prompts, split


def test_shipped_sets_and_held_out_splits() -> None:
    sets = {name: read_prompts(None, name) for name in ("refuse", "comply", "refuse_heldout", "comply_heldout")}
    assert [len(sets[n]) for n in sets] == [128, 128, 64, 64]
    assert not set(sets["refuse"]) & set(sets["refuse_heldout"])
    assert not set(sets["comply"]) & set(sets["comply_heldout"])
    assert not set(sets["refuse"]) & set(sets["comply"])
    train, val = split(sets["refuse"], 0.25, seed=0)
    assert (len(train), len(val)) == (96, 32) and not set(train) & set(val)
    assert split(sets["refuse"], 0.25, seed=0) == (train, val)  # deterministic
    assert split(sets["refuse"], 0.25, seed=1) != (train, val)


def test_prompt_files(tmp_path: Path) -> None:
    from tokenmill.errors import ConfigError

    path = tmp_path / "p.txt"
    path.write_text("# a comment\n\nfirst\n  second  \n")
    assert read_prompts(path, "refuse") == ["first", "second"]
    path.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts(path, "refuse")
    with pytest.raises(ConfigError, match="cannot read"):
        read_prompts(tmp_path / "missing.txt", "refuse")


@pytest.mark.slow
def test_a_small_build_on_smollm2(tmp_path: Path) -> None:
    from tokenmill.cli import main
    from tokenmill.models.steering_file import load_steering_file

    refuse, comply = tmp_path / "refuse.txt", tmp_path / "comply.txt"
    refuse.write_text("\n".join(read_prompts(None, "refuse")[:36]))
    comply.write_text("\n".join(read_prompts(None, "comply")[:24]))
    out = tmp_path / "steer"
    assert main(["steer", "build", "--refuse", str(refuse), "--comply", str(comply), "--out", str(out), "--device", "cpu",
                 "--layers", "8,12", "--shortlist", "1", "--score-tokens", "12", "--max-comply-kl", "10"]) == 0
    file = load_steering_file(out)
    direction = file.directions["refusal"]
    assert direction.layer in (8, 12) and direction.vector.shape == (576,)
    meta = json.loads((out / "steering.json").read_text())
    assert meta["model"]["architecture"] == "LlamaForCausalLM" and meta["model"]["fingerprint"].startswith("sha256:")
    entry = meta["directions"]["refusal"]
    assert entry["positions"]["tokens"] == ["<|im_end|>", "Ċ", "<|im_start|>", "ass", "istant", "Ċ"]
    assert {"normalization", "ablation", "scores", "detector"} <= set(entry)
    assert len(entry["scores"]["candidates"]) == 4 and len(entry["scores"]["shortlist"]) == 1
    assert meta["build"]["prompts"] == {"refuse": {"train": 27, "val": 9}, "comply": {"train": 18, "val": 6}}
    assert file.candidates["refusal"].shape == (30, 576)

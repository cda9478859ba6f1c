"""The command line: every engine flag is documented; generate prints answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import save_tiny_checkpoint

from tokenmill.cli import build_parser, main


def test_every_generate_flag_has_help() -> None:
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    for action in generate._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 5, f"{action.option_strings} has no help"


def test_generate_refuses_text_for_a_model_without_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny_checkpoint("qwen3", tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_on_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "20",
                 "--json", "--device", "cpu"])
    assert code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in line["text"] and line["finish_reason"] in ("stop", "length")

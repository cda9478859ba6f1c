"""Draft vocabularies: file formats, clear errors, building from traffic, the head helpers, CLI."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.errors import ConfigError
from tokenmill.speculative.draft_vocab import (
    build_draft_vocab,
    count_tokens,
    load_draft_vocab,
    map_draft_ids,
    restrict_head,
    save_draft_vocab,
    select_top,
)

WORDS = "the cat sat on a mat dog ran".split()  # ids 2..9 in the tiny tokenizer; <unk> 0, <eos> 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with only config.json and a word-level tokenizer (no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("tiny_tok")
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>"}))
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 1, "intermediate_size": 8}))
    return directory


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model: Path):
    from tokenmill.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(str(tiny_model), need_weights=False))


def write_logs(directory: Path) -> None:
    """Two days of request logs (one gzipped) with known counts."""
    directory.mkdir(parents=True, exist_ok=True)
    day1 = [
        {"id": "a-0", "model": "m", "prompt_token_ids": [50, 50, 50, 50], "output_token_ids": [7, 7, 7, 3, 9],
         "finish_reason": "stop", "time": 1.0},
        {"id": "b-0", "model": "m", "prompt_token_ids": [50], "output_token_ids": [3, 9, 4],
         "finish_reason": "length", "time": 2.0},
    ]
    (directory / "requests-2025-01-01.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in day1) + '{"id": "half-written', encoding="utf-8")
    day2 = [{"id": "c-0", "model": "m", "prompt_token_ids": [50], "output_token_ids": [8, 7, 2],
             "finish_reason": "stop", "time": 90000.0}]
    with gzip.open(directory / "requests-2025-01-02.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in day2)
    (directory / "notes.md").write_text("not a log")
    # output counts: 7 x4, 3 x2, 9 x2, 4 x1, 8 x1, 2 x1 (11 tokens); prompts add 50 x6


# ---------------------------------------------------------------------------- files

@pytest.mark.parametrize("name", ["ids.txt", "ids.txt.gz", "ids.npy", "sub/dir/IDS.TXT.GZ"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    ids = [5, 3, 3, 100_000, 0, 42]
    path = save_draft_vocab(ids, tmp_path / name)
    loaded = load_draft_vocab(path)
    assert loaded.dtype == torch.int64
    assert loaded.tolist() == [0, 3, 5, 42, 100_000]
    assert load_draft_vocab(save_draft_vocab(loaded, tmp_path / ("again_" + Path(name).name))).tolist() == loaded.tolist()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_text_is_whitespace_separated_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "ids.txt"
    path.write_text("# top tokens\n3 1\t2\n\n  7  # seven\n1\n")
    assert load_draft_vocab(path).tolist() == [1, 2, 3, 7]
    assert load_draft_vocab(path, vocab_size=8).tolist() == [1, 2, 3, 7]


def bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    cases = []

    def text(name: str, body: str | bytes, match: str) -> None:
        path = tmp_path / name
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
        cases.append((path, match))

    text("words.txt", "1 2\n3 four 5\n", "line 2: 'four' is not an integer")
    text("float.txt", "1 2.5\n", "'2.5' is not an integer")
    text("neg.txt", "1 -4 2\n", "negative ids, e.g. -4")
    text("empty.txt", "# nothing here\n\n", "holds no token ids")
    text("notgz.txt.gz", "1 2 3\n", "cannot be read")
    text("binary.txt", b"\xff\xfe\x00\x01", "cannot be read")
    np.save(tmp_path / "floats.npy", np.array([1.0, 2.0]))
    cases.append((tmp_path / "floats.npy", "integer ids, not float64"))
    np.save(tmp_path / "matrix.npy", np.zeros((2, 2), dtype=np.int64))
    cases.append((tmp_path / "matrix.npy", "1-D array"))
    np.save(tmp_path / "objects.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    cases.append((tmp_path / "objects.npy", "not a plain .npy"))
    np.save(tmp_path / "none.npy", np.zeros(0, dtype=np.int32))
    cases.append((tmp_path / "none.npy", "holds no token ids"))
    text("junk.npy", "hello", "not a plain .npy")
    cases.append((tmp_path / "missing.txt", "does not exist"))
    cases.append((tmp_path / "ids.csv", "must end in .txt, .txt.gz, .npy"))
    return cases


def test_bad_files_give_clear_errors(tmp_path: Path) -> None:
    for path, match in bad_files(tmp_path):
        with pytest.raises(ConfigError, match=match) as info:
            load_draft_vocab(path)
        assert path.name in str(info.value)
        assert isinstance(info.value, ValueError)
    path = save_draft_vocab([1, 2, 30], tmp_path / "big.txt")
    with pytest.raises(ConfigError, match="id 30, outside the model's vocabulary of 16 tokens"):
        load_draft_vocab(path, vocab_size=16)
    with pytest.raises(ConfigError, match="empty"):
        save_draft_vocab([], tmp_path / "e.txt")
    with pytest.raises(ConfigError, match="negative"):
        save_draft_vocab([3, -1], tmp_path / "n.npy")


# ---------------------------------------------------------------------------- head helpers

def test_restrict_head_and_map_ids() -> None:
    weight = torch.randn(10, 4)
    ids = torch.tensor([1, 4, 7, 9])
    head = restrict_head(weight, ids)
    assert head.shape == (4, 4) and head.is_contiguous()
    hidden = torch.randn(3, 4)
    rows = (hidden @ head.T).argmax(-1)
    # the restricted head's argmax, mapped back, is the full head's argmax over S
    full = hidden @ weight.T
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    assert torch.equal(map_draft_ids(rows, ids), masked.argmax(-1))
    assert map_draft_ids(torch.tensor([[0, 3], [2, 1]]), ids).tolist() == [[1, 9], [7, 4]]
    with pytest.raises(ConfigError, match=r"\[0, 10\)"):
        restrict_head(weight, torch.tensor([3, 10]))


# ---------------------------------------------------------------------------- build

def test_build_ranks_by_frequency_from_log_dir(tmp_path: Path) -> None:
    write_logs(tmp_path / "logs")
    counts = count_tokens(tmp_path / "logs")
    assert counts.total == 11 and counts.num_records == 3 and counts.num_skipped == 1
    # 7 (4x), then 3 and 9 (2x, ties by id), then 2, 4, 8 (1x, ties by id)
    assert build_draft_vocab(tmp_path / "logs", 4) == [7, 3, 9, 2]
    assert build_draft_vocab(tmp_path / "logs", 100) == [7, 3, 9, 2, 4, 8]
    # specials always kept, first, counted against the size
    assert build_draft_vocab(tmp_path / "logs", 4, special_ids=[1, 0, 1]) == [1, 0, 7, 3]
    assert build_draft_vocab(tmp_path / "logs", 3, include_prompts=True) == [50, 7, 3]
    assert counts.coverage([7, 3, 9]) == pytest.approx(8 / 11)
    assert counts.coverage([7, 3, 9, 2, 4, 8, 12345]) == 1.0
    # the gzip file alone, as a file source
    assert build_draft_vocab(tmp_path / "logs" / "requests-2025-01-02.jsonl.gz", 2) == [2, 7]


def test_build_from_texts(tmp_path: Path, tiny_tokenizer) -> None:
    texts = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": t}) for t in ("the cat sat on the mat", "the dog ran", "a cat")]
    texts.write_text("\n".join(lines + ["", "not json", '{"other": 1}']))
    counts = count_tokens(texts, tiny_tokenizer)
    # the x3, cat x2, then sat on mat dog ran a x1 each (ids 4,5,7,8,9,6)
    assert counts.total == 11 and counts.num_records == 3 and counts.num_skipped == 2
    assert build_draft_vocab(texts, 4, tiny_tokenizer) == [2, 3, 4, 5]
    assert build_draft_vocab(texts, 3, tiny_tokenizer, special_ids=[1]) == [1, 2, 3]


def test_build_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_draft_vocab(tmp_path / "nope", 10)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="no \\*.jsonl"):
        build_draft_vocab(tmp_path / "empty_dir", 10)
    (tmp_path / "blank.jsonl").write_text('{"output_token_ids": []}\n')
    with pytest.raises(ConfigError, match="no tokens found"):
        build_draft_vocab(tmp_path / "blank.jsonl", 10)
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match="broken.jsonl.gz cannot be read"):
        build_draft_vocab(tmp_path / "broken.jsonl.gz", 10)
    with pytest.raises(ConfigError, match="at least 1"):
        select_top(np.array([1, 2]), 0)
    with pytest.raises(ConfigError, match="do not fit"):
        select_top(np.array([1, 2]), 1, special_ids=[0, 1])


# ---------------------------------------------------------------------------- CLI

def run_cli(argv: list[str]) -> int:
    from tokenmill.speculative.cli import register

    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_cli_end_to_end(tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path / "logs")
    out = tmp_path / "ids.txt.gz"
    assert run_cli(["draft-vocab", "build", "--from", str(tmp_path / "logs"), "--size", "4", "--out", str(out),
                    "--model", str(tiny_model)]) == 0
    captured = capsys.readouterr()
    # <unk> 0 and <eos> 1 are special, kept first; then 7 and 3 (7/11 + ... of the counted tokens)
    assert load_draft_vocab(out).tolist() == [0, 1, 3, 7]
    assert "counted 11 tokens in 3 records" in captured.out
    assert f"{100 * 6 / 11:.2f}%" in captured.out  # 7 x4 + 3 x2 of 11
    assert "counting tokens" in captured.err  # the progress bar

    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "the cat sat"}\n{"text": "the the dog"}\n')
    out_npy = tmp_path / "ids.npy"
    assert run_cli(["draft-vocab", "build", "--from", str(texts), "--from", str(tmp_path / "logs"),
                    "--include-prompts", "--size", "100", "--out", str(out_npy), "--model", str(tiny_model),
                    "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "counted 23 tokens in 5 records" in captured.out  # 6 text tokens + 11 output + 6 prompt
    assert "coverage of the top 9: 100.00%" in captured.out
    assert "fewer than --size 100" in captured.out and "counting tokens" not in captured.err
    assert load_draft_vocab(out_npy).tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 50]


def test_cli_errors_and_help(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        run_cli(["draft-vocab", "build", "--from", str(tmp_path / "none"), "--size", "4", "--out",
                 str(tmp_path / "x.txt"), "--model", str(tiny_model)])
    with pytest.raises(ConfigError, match="at least 1"):
        run_cli(["draft-vocab", "build", "--from", str(tmp_path), "--size", "0", "--out", str(tmp_path / "x.txt")])
    with pytest.raises(SystemExit):
        run_cli(["draft-vocab"])  # the action is required
    from tokenmill.speculative.cli import register

    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = register(parser.add_subparsers())
    build = sub._subparsers._group_actions[0].choices["build"]  # type: ignore[union-attr]
    for action in build._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 5, action.option_strings

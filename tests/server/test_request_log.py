"""--log-requests-dir: each finished sequence appends one JSON line to the day's file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from server_harness import RunningServer, start_server_on

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.request_log import RequestLog

KEYS = {"id", "model", "prompt_token_ids", "output_token_ids", "finish_reason", "time"}


def read_log(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("requests-*.jsonl"))
            for line in path.read_text().splitlines()]


def test_served_requests_are_logged(server: RunningServer, tmp_path: Path) -> None:
    with start_server_on(server, request_log_dir=str(tmp_path / "logs")) as logged:
        client = logged.client()
        done = client.completions.create(model=logged.state.model_name, prompt="The capital of France is",
                                         max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
        stream = client.chat.completions.create(
            model=logged.state.model_name, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3,
            temperature=0, stream=True, extra_body={"return_token_ids": True},
        )
        chunks = list(stream)
    files = list((tmp_path / "logs").iterdir())
    assert len(files) == 1 and files[0].name.startswith("requests-20") and files[0].suffix == ".jsonl"
    records = read_log(tmp_path / "logs")
    assert len(records) == 2 and all(set(r) == KEYS for r in records)
    by_id = {r["id"]: r for r in records}

    choice = done.choices[0].model_extra
    completion = by_id[f"{done.id}-0"]
    assert completion["model"] == logged.state.model_name
    assert completion["prompt_token_ids"] == choice["prompt_token_ids"]
    assert completion["output_token_ids"] == choice["token_ids"] and len(choice["token_ids"]) == 4
    assert completion["finish_reason"] == "length" and completion["time"] > 1.7e9

    chat = by_id[f"{chunks[0].id}-0"]
    streamed_ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or []) if c.choices]
    assert chat["output_token_ids"] == streamed_ids and 1 <= len(streamed_ids) <= 3
    assert chat["prompt_token_ids"] == next(c.model_extra["prompt_token_ids"] for c in chunks
                                            if c.model_extra.get("prompt_token_ids"))
    assert chat["finish_reason"] in ("stop", "length")

    # the plain server (no flag) writes nothing and is unaffected
    assert server.state.request_log is None


def test_serve_flag_is_parsed() -> None:
    from tokenmill.cli import build_parser

    args = build_parser().parse_args(["serve", "--log-requests-dir", "/tmp/x"])
    assert args.log_requests_dir == "/tmp/x"
    assert build_parser().parse_args(["serve"]).log_requests_dir is None


def output(request_id: str, ids: list[int], reason: str | None) -> RequestOutput:
    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", ids, finish_reason=reason)],
                         finished=reason is not None)


def test_daily_files_n_children_and_aborts(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "new" / "dir")  # created on demand
    stream = SimpleNamespace(child_ids=["r-0", "r-1", "r-2"])
    children = [SimpleNamespace(prompt=[1, 2]), SimpleNamespace(prompt=[1, 2]), SimpleNamespace(prompt=[3])]
    log.watch(stream, "m", children)
    recorder = stream.observer
    recorder.output(1, output("r-1", [5, 6], None))
    recorder.output(1, output("r-1", [7], "stop"))
    recorder.output(0, output("r-0", [8], None))
    recorder.aborted()  # the client left: the unfinished ones are logged as aborted, once
    recorder.aborted()
    records = read_log(tmp_path / "new" / "dir")
    assert [(r["id"], r["prompt_token_ids"], r["output_token_ids"], r["finish_reason"]) for r in records] == [
        ("r-1", [1, 2], [5, 6, 7], "stop"), ("r-0", [1, 2], [8], "abort"), ("r-2", [3], [], "abort")]

    log.write({"id": "x", "time": 0.0})  # 1970-01-01 UTC
    log.write({"id": "y", "time": 86_400.5})
    assert (tmp_path / "new" / "dir" / "requests-1970-01-01.jsonl").read_text() == '{"id":"x","time":0.0}\n'
    assert json.loads((tmp_path / "new" / "dir" / "requests-1970-01-02.jsonl").read_text())["id"] == "y"


def test_log_dir_feeds_draft_vocab_build(tmp_path: Path) -> None:
    from tokenmill.speculative.draft_vocab import build_draft_vocab

    log = RequestLog(tmp_path)
    for i, ids in enumerate([[4, 4, 9], [4, 2], [9, 4]]):
        log.write({"id": f"r{i}-0", "model": "m", "prompt_token_ids": [1], "output_token_ids": ids,
                   "finish_reason": "stop"})
    assert build_draft_vocab(tmp_path, 2) == [4, 9]

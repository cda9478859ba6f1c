"""`--log-requests-dir`: one JSON line per finished sequence, in a file per UTC day.

    {"id", "model", "prompt_token_ids", "output_token_ids", "finish_reason", "time"}

`id` is the engine request id of the sequence (the API request id plus `-<index>`, one line per
choice when n > 1 or a batch of prompts); `time` is the finish time in Unix seconds. The files
(`requests-YYYY-MM-DD.jsonl`) are what `tokenmill draft-vocab build --from DIR` reads.
Lines are appended whole, under a lock, so readers see complete records.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path_for(self, when: float) -> Path:
        return self.directory / time.strftime("requests-%Y-%m-%d.jsonl", time.gmtime(when))

    def write(self, record: dict[str, Any]) -> None:
        """Appends one record (its `time`, or now, picks the day's file); never raises."""
        when = record.setdefault("time", time.time())
        line = json.dumps(record, separators=(",", ":")) + "\n"
        try:
            with self._lock, open(self.path_for(when), "a", encoding="utf-8") as f:
                f.write(line)
        except OSError:
            logger.exception("could not write the request log in %s", self.directory)

    def watch(self, stream: Any, model: str, children: Sequence[Any]) -> None:
        """Logs every sequence of `stream` (a RequestStream) as it finishes; sequences still
        running when the stream is aborted (client gone) are logged with finish_reason abort.
        `children` are the submitted ChildRequests (their prompts are token-id lists)."""
        stream.observer = _Recorder(self, model, list(stream.child_ids), [c.prompt for c in children])


class _Recorder:
    """Collects one API request's output ids per sequence (runs on the event loop)."""

    def __init__(self, log: RequestLog, model: str, ids: list[str], prompts: list[Any]) -> None:
        self.log, self.model, self.ids, self.prompts = log, model, ids, prompts
        self.outputs: list[list[int]] = [[] for _ in ids]
        self.done = [False] * len(ids)

    def output(self, index: int, output: RequestOutput) -> None:
        completion = output.outputs[0] if output.outputs else None
        if completion is not None:
            self.outputs[index] += completion.token_ids
        if output.finished and not self.done[index]:
            reason = completion.finish_reason if completion is not None else None
            self._write(index, reason or "stop")

    def aborted(self) -> None:
        for index, done in enumerate(self.done):
            if not done:
                self._write(index, "abort")

    def _write(self, index: int, reason: str) -> None:
        self.done[index] = True
        prompt = self.prompts[index]
        self.log.write({
            "id": self.ids[index], "model": self.model,
            "prompt_token_ids": list(prompt) if isinstance(prompt, list) else [],
            "output_token_ids": self.outputs[index], "finish_reason": reason, "time": time.time(),
        })

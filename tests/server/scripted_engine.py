"""A scripted stand-in for LLMEngine (no model): each request yields max_tokens one-token deltas,
one per step(), and a step can be made to raise."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


class ScriptedEngine:
    def __init__(self, fail_on_step: int | None = None, step_seconds: float = 0.01, max_running: int = 1000) -> None:
        self.requests: dict[str, list[int]] = {}  # running: [max_tokens, generated]
        self.waiting: list[tuple[str, int]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.fail: Callable[[], None] | None = None  # called in step(); may raise
        self.step_seconds = step_seconds
        self.max_running = max_running
        self.threads: set[str] = set()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, steering: dict[str, float] | None = None) -> None:
        self.threads.add(threading.current_thread().name)
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        self.waiting.append((request_id, params.max_tokens or 16))

    def abort_request(self, request_id: str) -> None:
        self.threads.add(threading.current_thread().name)
        waiting = [w for w in self.waiting if w[0] == request_id]
        if self.requests.pop(request_id, None) is not None or waiting:
            self.aborted.append(request_id)
            self.waiting = [w for w in self.waiting if w[0] != request_id]

    def abort_failed_step(self) -> list[str]:
        """As LLMEngine's: the running requests, or, when none runs, the one being admitted."""
        held = list(self.requests) or [w[0] for w in self.waiting[:1]]
        for request_id in held:
            self.abort_request(request_id)
        return held

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.waiting)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        while self.waiting and len(self.requests) < self.max_running:
            request_id, max_tokens = self.waiting.pop(0)
            self.requests[request_id] = [max_tokens, 0]
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("kernel exploded")
        if self.fail is not None:
            self.fail()
        time.sleep(self.step_seconds)
        outputs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            outputs.append(RequestOutput(rid, None, [1, 2], [CompletionOutput(
                0, f"t{state[1]} ", [100 + state[1]], finish_reason="length" if done else None)], finished=done))
            if done:
                del self.requests[rid]
        return outputs

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests)}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)



class AnswerEngine(ScriptedEngine):
    """A scripted engine the real server can serve (the model attributes a server reads, over a
    real tokenizer): each request answers the `answer` set when it was added, `piece` characters
    per step, and then stops ("stop", as at EOS)."""

    def __init__(self, tokenizer: Any, answer: str = "", piece: int = 3) -> None:
        super().__init__(step_seconds=0.0)
        self.tokenizer, self.answer, self.piece = tokenizer, answer, piece
        self.model_name = "scripted"
        self.hf_config = SimpleNamespace(vocab_size=len(tokenizer))
        self.source = SimpleNamespace(path="scripted")
        self.config = SimpleNamespace(model=SimpleNamespace(max_model_len=4096))
        self.answers: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, steering: dict[str, float] | None = None) -> None:
        super().add_request(request_id, prompt, SamplingParams(max_tokens=max(1, -(-len(self.answer) // self.piece))))
        self.answers[request_id] = self.answer

    def step(self) -> list[RequestOutput]:
        while self.waiting:
            request_id, steps = self.waiting.pop(0)
            self.requests[request_id] = [steps, 0]
        outputs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            text = self.answers[rid][(state[1] - 1) * self.piece:state[1] * self.piece]
            outputs.append(RequestOutput(rid, None, [1, 2], [CompletionOutput(
                0, text, [100 + state[1]], finish_reason="stop" if done else None)], finished=done))
            if done:
                del self.requests[rid], self.answers[rid]
        return outputs

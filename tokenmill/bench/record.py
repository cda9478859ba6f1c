"""What one streamed request left behind, and how its tokens are counted.

Token counts prefer the server's per-chunk `token_ids`, then the `usage` block, then a local
tokenizer, then one token per chunk (llama-benchy's order); per-token arrival times are the
chunk times, spread evenly inside a chunk or across the stream when only a total is known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any


@dataclass
class TokenChunk:
    t: float
    text: str
    ids: list[int] | None


@dataclass
class RequestRecord:
    start: float = 0.0
    end: float = 0.0
    first_response: float | None = None  # first chunk with a choice (vLLM's TTFT, llama-benchy's ttfr)
    first_token: float | None = None  # first chunk with generated text
    last_data: float | None = None  # last JSON chunk (usage included): vLLM's end of a request
    choice_times: list[float] = field(default_factory=list)
    chunks: list[TokenChunk] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage_prompt: int | None = None
    usage_completion: int | None = None
    prompt_ids: int | None = None
    status: int | None = None
    done: bool = False
    error: str | None = None
    # set by finalize()
    output_tokens: int = 0
    token_source: str = ""
    token_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def n_chunks(self) -> int:
        return len(self.choice_times)

    def prompt_len(self, expected: int) -> int:
        if self.prompt_ids:
            return self.prompt_ids
        if self.usage_prompt:
            return self.usage_prompt
        return expected

    def itls(self) -> list[float]:
        """Gaps between successive chunks that carried a choice (vLLM's ITL)."""
        t = self.choice_times
        return [b - a for a, b in pairwise(t)]

    def calls(self) -> list[dict[str, Any]]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]

    def to_json(self, origin: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - origin, 6)

        return {
            "start": rel(self.start),
            "end": rel(self.end),
            "first_response": rel(self.first_response),
            "first_token": rel(self.first_token),
            "prompt_tokens": self.prompt_ids or self.usage_prompt,
            "output_tokens": self.output_tokens,
            "token_source": self.token_source,
            "token_times": [round(t - origin, 6) for t in self.token_times],
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


def apply_delta(rec: RequestRecord, chunk: dict[str, Any], now: float) -> bool:
    """Fold one parsed SSE chunk into `rec`; True when it carried a choice."""
    rec.last_data = now
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            rec.usage_prompt = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            rec.usage_completion = usage["completion_tokens"]
    if isinstance(chunk.get("prompt_token_ids"), list):
        rec.prompt_ids = len(chunk["prompt_token_ids"])
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if rec.first_response is None:
        rec.first_response = now
    rec.choice_times.append(now)
    if isinstance(choice.get("prompt_token_ids"), list):
        rec.prompt_ids = len(choice["prompt_token_ids"])
    if choice.get("finish_reason"):
        rec.finish_reason = str(choice["finish_reason"])
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    args = _merge_tool_calls(rec, delta.get("tool_calls"))
    ids = choice.get("token_ids")
    ids = list(ids) if isinstance(ids, list) else None
    piece = content + reasoning + args
    if piece or ids:
        if rec.first_token is None:
            rec.first_token = now
        rec.text += content
        rec.reasoning += reasoning
        rec.chunks.append(TokenChunk(now, piece, ids))
    return True


def _merge_tool_calls(rec: RequestRecord, deltas: Any) -> str:
    """Assemble streamed `delta.tool_calls` fragments by index; returns the new text."""
    if not isinstance(deltas, list):
        return ""
    added = ""
    for pos, d in enumerate(deltas):
        if not isinstance(d, dict):
            continue
        idx = d.get("index", pos)
        call = rec.tool_calls.setdefault(
            int(idx), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if d.get("id"):
            call["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
            added += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]
            added += fn["arguments"]
    return added


def finalize(rec: RequestRecord, local_count: Callable[[str], int] | None = None) -> RequestRecord:
    """Set output_tokens, token_source and token_times from what arrived."""
    chunks = rec.chunks
    rec.token_times = []
    if not chunks:
        rec.output_tokens = rec.usage_completion or 0
        rec.token_source = "usage" if rec.usage_completion is not None else "none"
        return rec
    if all(c.ids is not None for c in chunks):
        for c in chunks:
            n = len(c.ids or [])
            if n == 1:
                rec.token_times.append(c.t)
            elif n > 1:
                prev = rec.token_times[-1] if rec.token_times else (rec.first_token or rec.start)
                rec.token_times.extend(prev + (c.t - prev) * (i + 1) / n for i in range(n))
        rec.output_tokens = len(rec.token_times)
        rec.token_source = "ids"
        return rec
    times = [c.t for c in chunks]
    if rec.usage_completion is not None:
        n, rec.token_source = rec.usage_completion, "usage"
    elif local_count is not None:
        n, rec.token_source = local_count("".join(c.text for c in chunks)), "local"
    else:
        n, rec.token_source = len(chunks), "chunks"
    rec.output_tokens = n
    rec.token_times = spread(times, n)
    return rec


def spread(times: list[float], n: int) -> list[float]:
    """n evenly spaced times from the first to the last chunk."""
    if n <= 0 or not times:
        return []
    if n == 1 or len(times) == 1 or times[-1] <= times[0]:
        return [times[0]] * n
    step = (times[-1] - times[0]) / (n - 1)
    return [times[0] + step * i for i in range(n)]

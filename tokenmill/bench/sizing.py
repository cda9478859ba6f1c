"""Prompts of a requested size in the server's tokens.

The local tokenizer may differ from the server's (the built-in one is an approximation), and
the chat template adds tokens. A warm-up fits server = slope * local + overhead from the
`usage.prompt_tokens` of three small requests, a generalisation of llama-benchy's
`--adapt-prompt` delta; with no usage block the local count is taken as is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.bench.client import Client
from tokenmill.bench.corpus import Corpus

CONTEXT_PROBE_USER = "."  # vLLM rejects an empty user turn; llama-benchy uses the same probe


@dataclass
class Calibration:
    slope: float = 1.0
    user_overhead: float = 0.0
    context_overhead: float = 0.0
    source: str = "none"

    def local(self, server_tokens: int, overhead: float) -> int:
        return max(1, round((server_tokens - overhead) / self.slope))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def messages(context: str, prompt: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    if context:
        out.append({"role": "system", "content": context})
    out.append({"role": "user", "content": prompt if prompt.strip() else CONTEXT_PROBE_USER})
    return out


class PromptSizer:
    def __init__(self, corpus: Corpus, calibration: Calibration | None = None) -> None:
        self.corpus = corpus
        self.cal = calibration or Calibration()

    def pair(self, prompt_tokens: int, depth: int, nonce: bool = True) -> tuple[str, str]:
        """(context, prompt) whose server token count is about prompt_tokens + depth; the
        template overhead comes out of the context when there is one (as llama-benchy)."""
        if depth > 0:
            return self.corpus.pair(
                self.cal.local(prompt_tokens, 0.0), self.cal.local(depth, self.cal.context_overhead), nonce
            )
        return self.corpus.pair(self.cal.local(prompt_tokens, self.cal.user_overhead), 0, nonce)

    def count_output(self, text: str) -> int:
        return max(0, round(self.corpus.count(text) * self.cal.slope))


async def _prompt_tokens(client: Client, msgs: list[dict[str, str]]) -> int | None:
    resp = await client.chat({"messages": msgs, "max_tokens": 1, "stream": False})
    usage = resp.get("usage") or {}
    value = usage.get("prompt_tokens")
    return int(value) if isinstance(value, int) and value > 0 else None


async def calibrate(client: Client, corpus: Corpus) -> Calibration:
    """Three warm-up requests (max_tokens 1); raises BenchError if the server fails them."""
    short = CONTEXT_PROBE_USER
    long = " ".join(corpus.slice(250) for _ in range(4))  # several offsets average out the text's mix
    n_short, n_long = corpus.count(short), corpus.count(long)
    p_short = await _prompt_tokens(client, messages("", short))
    p_long = await _prompt_tokens(client, messages("", long))
    p_ctx = await _prompt_tokens(client, messages(long, CONTEXT_PROBE_USER))
    if p_short is None or p_long is None or n_long <= n_short:
        return Calibration(source="none")
    slope = (p_long - p_short) / (n_long - n_short)
    if slope <= 0:
        return Calibration(source="none")
    user_overhead = p_short - slope * n_short
    ctx_overhead = (p_ctx - slope * n_long) if p_ctx is not None else user_overhead
    return Calibration(slope=slope, user_overhead=user_overhead, context_overhead=ctx_overhead, source="usage")

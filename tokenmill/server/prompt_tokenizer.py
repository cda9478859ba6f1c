"""Tokenizing, detokenizing and chat templating for the server, on bounded worker pools.

None of it runs on the event loop, so a large request never delays `/health`; and a request
whose body is over LARGE_BODY_BYTES does its work on a lane of its own (one thread), so small
requests never queue behind it.
A fast (Rust) tokenizer's batch calls release the GIL while they work, so the pool calls those
directly when they give exactly what the Hugging Face wrapper gives (checked at start-up on a
sample); Jinja templating holds the GIL but yields it every switch interval.

An over-long prompt is refused without tokenizing all of it: a prompt of more than
`PREFIX_CHARS_PER_TOKEN` × limit characters is first tokenized up to a word boundary (a space
between a non-space and a letter) near that length. When that prefix alone has more tokens than
the limit, so does the whole prompt: a tokenizer that splits text into words before merging
(byte-level BPE, SentencePiece) tokenizes a prefix ending at a word boundary into a prefix of the
whole's tokens. Start-up checks this property on a sample; a tokenizer without it tokenizes
every prompt whole.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.errors import InvalidRequestError

T = TypeVar("T")
LARGE_BODY_BYTES = 256 * 1024
PREFIX_CHARS_PER_TOKEN = 8
_BOUNDARY = re.compile(r"(?<=\S) (?=[^\W\d_])")
_BOUNDARY_SEARCH = 4096  # characters searched back from the cut for a word boundary
_SAMPLE = (
    "Hello, world! The quick brown fox (aged 12) jumps over 3 lazy dogs... naïve café, Zürich; "
    "def f(x):\n    return x ** 2  # squares\n\n  Indented   spaces\tand tabs. URL: https://example.com/a?b=c "
    "Emoji 😀 and ünïcödé wörds, 日本語のテキスト and 中文 mixed with English words. Don't stop; it's fine "
    "Numbers 1234567 3.14159 -42 e=mc2. ALL CAPS WORDS and MixedCase tokens, snake_case and kebab-case end."
)


class PromptTooLongError(InvalidRequestError):
    pass


class PromptTokenizer:
    """The server's tokenizer calls, run on `workers` threads (and one for large requests)."""

    def __init__(self, tokenizer: Any, workers: int) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenmill-tokenize")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenize-large")
        self._backend = _exact_backend(tokenizer)
        self.bounds_by_prefix = self._backend is not None and _prefixes_tokenize_as_prefixes(self._backend)

    async def run(self, fn: Callable[..., T], *args: Any, body_bytes: int = 0, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a worker: the large lane for a request of `body_bytes` over
        LARGE_BODY_BYTES."""
        pool = self._large if body_bytes > LARGE_BODY_BYTES else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, *, add_special_tokens: bool, max_tokens: int | None = None) -> list[int]:
        """The token ids of `text` (call it on the pool). With `max_tokens`, a text whose prefix
        alone has more tokens raises PromptTooLongError before the rest is tokenized."""
        if max_tokens is not None and self.bounds_by_prefix and len(text) > PREFIX_CHARS_PER_TOKEN * (max_tokens + 1):
            cut = _word_boundary_before(text, PREFIX_CHARS_PER_TOKEN * (max_tokens + 1))
            if cut is not None:
                counted = len(self._ids(text[:cut], add_special_tokens))
                if counted > max_tokens:
                    raise PromptTooLongError(
                        f"This model's maximum context length is {max_tokens + 1} tokens. However, your request "
                        f"has more than {counted} input tokens (the first {cut} of its {len(text)} characters "
                        "alone). Please reduce the length of the input.")
        return self._ids(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (call it on the pool)."""
        if self._backend is not None:
            return self._backend.decode_batch([ids], skip_special_tokens=False)[0]
        return self.tokenizer.decode(ids)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def shutdown(self) -> None:
        for pool in (self._pool, self._large):
            pool.shutdown(wait=False, cancel_futures=True)


def _word_boundary_before(text: str, pos: int) -> int | None:
    start = max(0, pos - _BOUNDARY_SEARCH)
    last = None
    for match in _BOUNDARY.finditer(text, start, pos):
        last = match.start()
    return last


def _exact_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a fast Hugging Face tokenizer when calling it directly gives the
    wrapper's ids and text on the sample (no truncation, no decode clean-up); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    sample = _sample_for(tokenizer)
    try:
        for add_special_tokens in (False, True):
            ids = backend.encode_batch([sample], add_special_tokens=add_special_tokens)[0].ids
            if ids != list(tokenizer.encode(sample, add_special_tokens=add_special_tokens)):
                return None
        if backend.decode_batch([ids], skip_special_tokens=False)[0] != tokenizer.decode(ids):
            return None
    except Exception:  # noqa: BLE001 - any surprise: use the wrapper
        return None
    return backend


def _prefixes_tokenize_as_prefixes(backend: Any) -> bool:
    """Whether every prefix of the sample that ends at a word boundary tokenizes into a prefix of
    the sample's tokens, and no special token holds such a boundary (a cut could split it)."""
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    if any(_BOUNDARY.search(text) for text in added):
        return False
    sample = _SAMPLE + " " + " ".join(added[:32]) + " tail words"
    cuts = [m.start() for m in _BOUNDARY.finditer(sample)]
    whole = backend.encode_batch([sample], add_special_tokens=False)[0].ids
    prefixes = backend.encode_batch([sample[:cut] for cut in cuts], add_special_tokens=False)
    return all(whole[: len(p.ids)] == p.ids for p in prefixes)


def _sample_for(tokenizer: Any) -> str:
    specials = list(getattr(tokenizer, "all_special_tokens", None) or [])[:8]
    return _SAMPLE + "".join(f" {t}x" for t in specials)

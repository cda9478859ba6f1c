"""The shipped public-domain corpus, local tokenizers, and fresh prompt slices.

Local token counts are only a fallback (the server's token ids or usage come first) and a way
to cut slices of about the right size; `sizing.py` calibrates them against the server.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Sequence
from typing import Protocol

from tokenmill.bench.errors import BenchError
from tokenmill.data import shipped_corpus_text

# Pieces of at most six letters, three digits or one symbol, each with its leading
# whitespace: close to a BPE tokenizer's count on English prose (about 1.3 per word), and
# joining any run of pieces gives back the exact text.
_PIECE = re.compile(r"\s*(?:[^\W\d_]{1,6}|\d{1,3}|_|[^\w\s])|\s+")


class LocalTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ApproxTokenizer:
    """Deterministic regex tokenizer; ids index a piece table grown on demand."""

    name = "approx"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _PIECE.findall(text):
            idx = self._ids.get(piece)
            if idx is None:
                idx = self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(idx)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


class HFTokenizer:
    """A Hugging Face tokenizer (tokenizers.Tokenizer or a transformers tokenizer)."""

    def __init__(self, name: str, backend: object) -> None:
        self.name = name
        self._tok = backend

    def encode(self, text: str) -> list[int]:
        enc = self._tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))  # type: ignore[attr-defined]


def load_tokenizer(spec: str | None) -> LocalTokenizer:
    """`spec`: None (built-in approximation), a tokenizer.json, a directory holding one, a
    .gguf file, or a model name already in the local Hugging Face cache."""
    if not spec:
        return ApproxTokenizer()
    try:
        if spec.endswith(".json") and os.path.isfile(spec):
            from tokenizers import Tokenizer

            return HFTokenizer(spec, Tokenizer.from_file(spec))
        if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
            from tokenizers import Tokenizer

            return HFTokenizer(spec, Tokenizer.from_file(os.path.join(spec, "tokenizer.json")))
        from transformers import AutoTokenizer

        if spec.endswith(".gguf") and os.path.isfile(spec):
            folder, name = os.path.split(os.path.abspath(spec))
            return HFTokenizer(spec, AutoTokenizer.from_pretrained(folder, gguf_file=name))
        return HFTokenizer(spec, AutoTokenizer.from_pretrained(spec))
    except Exception as exc:  # any loader failure becomes one clear line
        raise BenchError(
            f"cannot load tokenizer {spec!r}: {type(exc).__name__}: {exc}. Pass a tokenizer.json, "
            "a folder with one, a .gguf file, or omit --tokenizer to use the built-in approximation."
        ) from None


def read_corpus_text(path: str | None = None) -> str:
    """The shipped corpus, or a UTF-8 text file given by the user."""
    if path:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            raise BenchError(f"cannot read corpus {path!r}: {exc.strerror}") from None
        if not text.strip():
            raise BenchError(f"corpus {path!r} is empty")
        return text
    return shipped_corpus_text()


class Corpus:
    """The corpus as local tokens; hands out fresh random slices with a leading nonce."""

    def __init__(self, tokenizer: LocalTokenizer, text: str | None = None, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokenizer.encode(text if text is not None else read_corpus_text())
        if len(self.tokens) < 16:
            raise BenchError("the corpus is too short (fewer than 16 tokens)")
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def slice(self, n: int) -> str:
        """n local tokens from a random offset, wrapping around the corpus end."""
        if n <= 0:
            return ""
        start = self.rng.randrange(len(self.tokens))
        ids: list[int] = []
        while len(ids) < n:
            take = self.tokens[start : start + n - len(ids)]
            ids.extend(take)
            start = 0
        return self.tokenizer.decode(ids)

    def nonce(self) -> str:
        return f"[{uuid.uuid4().hex[:8]}] "

    def pair(self, prompt_tokens: int, context_tokens: int, nonce: bool = True) -> tuple[str, str]:
        """(context, prompt): the nonce opens the first message so no two requests share a
        prefix; its local tokens come out of that message's budget."""
        head = self.nonce() if nonce else ""
        head_len = self.count(head) if head else 0
        if context_tokens > 0:
            context = head + self.slice(max(1, context_tokens - head_len))
            return context, self.slice(max(1, prompt_tokens))
        return "", head + self.slice(max(1, prompt_tokens - head_len))

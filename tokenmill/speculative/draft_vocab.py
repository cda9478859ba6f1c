"""Draft vocabularies: the draft's output head restricted to a subset S of token ids.

Files hold ids as text (`.txt`, whitespace separated, `#` starts a comment), gzipped text
(`.txt.gz`) or a 1-D integer numpy array (`.npy`). Loaded, S is sorted and unique: row j of the
restricted head is target id S[j]. S is built from the deployment's own traffic (the request
logs `tokenmill serve --log-requests-dir` writes, or a JSONL of {"text": ...}) by frequency.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".txt.gz", ".npy")
_TEXT_BATCH = 256  # texts tokenized per tokenizer call
_FLUSH = 1 << 20  # ids buffered before a bincount


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for suffix in (".txt.gz", ".txt", ".npy"):
        if name.endswith(suffix):
            return suffix
    raise ConfigError(f"{path}: a draft vocabulary file must end in {', '.join(SUFFIXES)}")


# ---------------------------------------------------------------------------- load / save

def load_draft_vocab(path: str | os.PathLike[str], vocab_size: int | None = None) -> torch.Tensor:
    """The ids in `path` as a sorted, unique int64 tensor. ConfigError (naming the file) when
    it is missing, unreadable, holds something other than non-negative integers, is empty, or
    (given `vocab_size`) holds an id outside [0, vocab_size)."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise ConfigError(f"draft vocabulary file {path} does not exist")
    try:
        if suffix == ".npy":
            ids = _load_npy(path)
        else:
            opener = gzip.open if suffix == ".txt.gz" else open
            with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
                ids = _parse_text(path, f)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"draft vocabulary file {path} cannot be read: {exc}") from exc
    if ids.size == 0:
        raise ConfigError(f"draft vocabulary file {path} holds no token ids")
    if (ids < 0).any():
        raise ConfigError(f"draft vocabulary file {path} holds negative ids, e.g. {int(ids[ids < 0][0])}")
    unique = np.unique(ids)
    if vocab_size is not None and unique[-1] >= vocab_size:
        raise ConfigError(
            f"draft vocabulary file {path} holds id {int(unique[-1])}, outside the model's vocabulary "
            f"of {vocab_size} tokens: was it built for another tokenizer?")
    return torch.from_numpy(unique.astype(np.int64))


def _parse_text(path: Path, lines: Iterable[str]) -> np.ndarray:
    ids: list[int] = []
    for number, line in enumerate(lines, 1):
        for word in line.split("#", 1)[0].split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ConfigError(
                    f"draft vocabulary file {path}, line {number}: {word[:40]!r} is not an integer token id"
                ) from None
    return np.asarray(ids, dtype=np.int64)


def _load_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise ConfigError(f"draft vocabulary file {path} is not a plain .npy array: {exc}") from exc
    if array.ndim != 1:
        raise ConfigError(f"draft vocabulary file {path} must hold a 1-D array of ids, not shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ConfigError(f"draft vocabulary file {path} must hold integer ids, not {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ConfigError(f"draft vocabulary file {path} holds ids too large for int64")
    return array.astype(np.int64)


def save_draft_vocab(ids: Iterable[int] | torch.Tensor | np.ndarray, path: str | os.PathLike[str]) -> Path:
    """Writes the ids, sorted and unique (the order rows take), as `.txt`, `.txt.gz` or `.npy`
    by the file's suffix; atomically (a reader never sees half a file). Returns the path."""
    path = Path(path)
    suffix = _suffix(path)
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    array = np.unique(np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64))
    if array.size == 0:
        raise ConfigError(f"refusing to write an empty draft vocabulary to {path}")
    if array[0] < 0:
        raise ConfigError(f"refusing to write negative token ids to {path}: {int(array[0])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if suffix == ".npy":
                np.save(f, array)
            else:
                data = ("\n".join(map(str, array.tolist())) + "\n").encode()
                f.write(gzip.compress(data, mtime=0) if suffix == ".txt.gz" else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------- the draft head

def restrict_head(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The output head [V, H] cut to the rows of `ids` ([|S|, H], contiguous): row j scores
    target token ids[j]."""
    if weight.dim() != 2:
        raise ValueError(f"the head weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    ids = ids.to(device=weight.device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        raise ConfigError(
            f"draft vocabulary ids must lie in [0, {weight.shape[0]}) for this head; got "
            f"[{int(ids.min())}, {int(ids.max())}]")
    return weight.index_select(0, ids).contiguous()


def map_draft_ids(draft_rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Target ids of rows sampled from the restricted head: ids[draft_rows] (any shape)."""
    ids = ids.to(draft_rows.device)
    return ids[draft_rows.long()]


# ---------------------------------------------------------------------------- build

@dataclass
class TokenCounts:
    """Token frequencies gathered from traffic."""

    counts: np.ndarray  # counts[t] = occurrences of token id t
    num_records: int = 0
    num_skipped: int = 0  # lines that were not valid JSON records (e.g. a half-written last line)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def coverage(self, ids: Iterable[int]) -> float:
        """Fraction of counted tokens whose id is in `ids`."""
        total = self.total
        chosen = np.fromiter((i for i in set(ids) if i < len(self.counts)), dtype=np.int64)
        return float(self.counts[chosen].sum()) / total if total else 0.0


class _Counter:
    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.num_pending = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.num_pending += ids.size
        if self.num_pending >= _FLUSH:
            self.flush()

    def flush(self) -> np.ndarray:
        if self.pending:
            ids = np.concatenate(self.pending)
            self.pending, self.num_pending = [], 0
            if ids.size:
                binc = np.bincount(ids)
                if binc.size > self.counts.size:
                    binc[: self.counts.size] += self.counts
                    self.counts = binc
                else:
                    self.counts[: binc.size] += binc
        return self.counts


def source_files(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files behind `sources`: a directory means its *.jsonl and *.jsonl.gz files."""
    items = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
            if not found:
                raise ConfigError(f"{path}: no *.jsonl or *.jsonl.gz request logs in this directory")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"{path} does not exist (give a directory of request logs or a .jsonl file)")
    return files


def _lines(path: Path) -> Iterator[tuple[bytes, int]]:
    """(line, bytes of the file read so far): compressed bytes for .gz, so progress is true."""
    with open(path, "rb") as raw:
        if not path.name.endswith(".gz"):
            for line in raw:
                yield line, len(line)
            return
        with gzip.GzipFile(fileobj=raw) as f:
            done = 0
            for line in f:
                position = raw.tell()
                yield line, position - done
                done = position


def count_tokens(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], tokenizer: Any = None, *,
    include_prompts: bool = False, progress: bool = False,
) -> TokenCounts:
    """Counts token ids in request-log records (their output_token_ids, and prompt_token_ids
    with `include_prompts`) and in {"text": ...} records, tokenized with `tokenizer` (the
    default model's when None and texts appear). Lines of neither kind are skipped, counted."""
    from tqdm.auto import tqdm

    files = source_files(sources)
    counter = _Counter()
    texts: list[str] = []
    result = TokenCounts(np.zeros(0, dtype=np.int64))

    def tokenize_pending() -> None:
        nonlocal tokenizer
        if not texts:
            return
        if tokenizer is None:
            tokenizer = default_tokenizer()
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            counter.add(np.asarray(ids, dtype=np.int64))
        texts.clear()

    total_bytes = sum(_size(p) for p in files)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="counting tokens", disable=not progress) as bar:
        for path in files:
            try:
                for line, read in _lines(path):
                    bar.update(read)
                    ids = _record_ids(line, include_prompts)
                    if ids is None:
                        result.num_skipped += line.strip() != b""
                        continue
                    result.num_records += 1
                    if isinstance(ids, str):
                        texts.append(ids)
                        if len(texts) >= _TEXT_BATCH:
                            tokenize_pending()
                    else:
                        counter.add(ids)
            except (OSError, EOFError) as exc:
                raise ConfigError(f"{path} cannot be read: {exc}") from exc
        tokenize_pending()
    result.counts = counter.flush()
    if result.num_skipped:
        logger.warning("skipped %d lines that were neither request-log records nor {\"text\": ...}", result.num_skipped)
    return result


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _record_ids(line: bytes, include_prompts: bool) -> np.ndarray | str | None:
    """The ids of one request-log line, the text of one {"text"} line, or None."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "output_token_ids" in record:
        parts = [record["output_token_ids"]] + ([record.get("prompt_token_ids") or []] if include_prompts else [])
        try:
            ids = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
        except (TypeError, ValueError, OverflowError):
            return None
        return None if ids.size and ids.min() < 0 else ids
    text = record.get("text")
    return text if isinstance(text, str) else None


def default_tokenizer() -> Any:
    """The default model's tokenizer."""
    from tokenmill.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    if tokenizer is None:
        raise ConfigError("the default model ships no tokenizer; pass one to tokenize texts")
    return tokenizer


def select_top(counts: np.ndarray, size: int, special_ids: Iterable[int] = ()) -> list[int]:
    """`size` ids: the special ids first, then observed ids by count (descending), ties by id.
    Fewer when fewer distinct tokens were seen."""
    if size < 1:
        raise ConfigError(f"the draft vocabulary size must be at least 1, got {size}")
    specials = list(dict.fromkeys(int(i) for i in special_ids))
    if any(i < 0 for i in specials):
        raise ConfigError(f"special ids must be non-negative, got {specials}")
    if len(specials) > size:
        raise ConfigError(f"{len(specials)} special ids do not fit in a draft vocabulary of {size}")
    seen = np.flatnonzero(counts)
    order = seen[np.lexsort((seen, -counts[seen]))]  # by count descending, then id ascending
    chosen = set(specials)
    ranked = specials + [int(i) for i in order if int(i) not in chosen][: size - len(specials)]
    return ranked


def build_draft_vocab(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], size: int, tokenizer: Any = None, *,
    special_ids: Iterable[int] = (), include_prompts: bool = False, progress: bool = False,
) -> list[int]:
    """The `size` most frequent token ids in the sources (see `count_tokens`), always
    including `special_ids` (EOS and friends), ranked: specials, then by frequency, ties by id."""
    counts = count_tokens(sources, tokenizer, include_prompts=include_prompts, progress=progress)
    if counts.total == 0:
        raise ConfigError(f"no tokens found in {', '.join(map(str, source_files(sources)))}")
    return select_top(counts.counts, size, special_ids)

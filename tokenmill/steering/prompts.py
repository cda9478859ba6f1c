"""Prompt sets for `tokenmill steer build`: reading them, splitting them, and the chat template's
post-instruction positions (the tokens after the user's message: where the model decides how to answer)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError

SHIPPED = {"refuse": "refuse.txt", "comply": "comply.txt", "refuse_heldout": "refuse_heldout.txt",
           "comply_heldout": "comply_heldout.txt"}
_SENTINEL = "Zq9 sentinel"


def read_prompts(path: str | Path | None, shipped: str) -> list[str]:
    """One prompt per line (blank lines and lines starting with # skipped); None: the shipped set."""
    if path is None:
        text = resources.files("tokenmill.data").joinpath(f"steering/{SHIPPED[shipped]}").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"cannot read the prompt file {path}: {error.strerror}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ConfigError(f"the prompt file {path or shipped} has no prompts")
    return prompts


def split(prompts: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, validation): a seeded shuffle, the first val_fraction held out for selection."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(order) * val_fraction))
    return order[n_val:], order[:n_val]


@dataclass(frozen=True)
class ChatPrompts:
    """The model's chat template applied to user messages; the last `post_instruction` tokens of
    every prompt are the template's own tokens after the message."""

    tokenizer: Any
    post_instruction: int
    post_instruction_tokens: tuple[str, ...]

    def encode(self, message: str) -> list[int]:
        return list(self.tokenizer(self.render(message), add_special_tokens=False).input_ids)

    def render(self, message: str) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                  tokenize=False)

    @classmethod
    def of(cls, tokenizer: Any) -> ChatPrompts:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenmill steer build needs a model whose tokenizer has a chat template")
        probe = cls(tokenizer, 0, ())
        text = probe.render(_SENTINEL)
        head = text[: text.index(_SENTINEL) + len(_SENTINEL)]
        full = probe.encode(_SENTINEL)
        prefix = list(tokenizer(head, add_special_tokens=False).input_ids)
        if full[: len(prefix)] != prefix or len(full) == len(prefix):
            raise ConfigError("cannot find the chat template's tokens after the user message (the message's last "
                              "token merges with the template's); tokenmill steer build cannot place the positions")
        tail = full[len(prefix):]
        return cls(tokenizer, len(tail), tuple(tokenizer.convert_ids_to_tokens(tail)))

"""<think> splitting, whole and streamed (in every chunking), for both parser styles."""

from __future__ import annotations

import pytest

from tokenmill.server.reasoning import ReasoningParser

CASES = [
    # (parser, prompt ending, answer, reasoning, content)
    ("qwen3", "", "<think>\nLet me add.\n</think>\n\nThe answer is 4.", "\nLet me add.\n", "The answer is 4."),
    ("qwen3", "", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "", "<think>cut off mid-thought", "cut off mid-thought", None),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "2+2 is 4.</think>Four.", "2+2 is 4.", "Four."),
    ("qwen3", "", "a < b and <thinking> is not a tag", None, "a < b and <thinking> is not a tag"),
    ("deepseek_r1", "", "First I think.</think>Then I answer.", "First I think.", "Then I answer."),
    ("deepseek_r1", "", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "", "still thinking", "still thinking", None),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_split_whole_and_streamed(name: str, prompt: str, text: str, reasoning: str | None,
                                  content: str | None, size: int) -> None:
    parser = ReasoningParser(name)
    assert parser.split(text, prompt) == (reasoning, content)
    stream = parser.new_stream(prompt)
    r, c = "", ""
    for i in range(0, len(text), size):
        part = stream.feed(text[i : i + size])
        r, c = r + part.reasoning, c + part.content
    last = stream.finish()
    r, c = r + last.reasoning, c + last.content
    assert (r or None, c or None) == (reasoning, content)


def test_unknown_parser() -> None:
    with pytest.raises(ValueError):
        ReasoningParser("nope")

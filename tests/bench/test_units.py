"""Pure pieces: statistics, token counting order, corpus slices, tables, option parsing."""

from __future__ import annotations

import math

import pytest

from tokenmill.bench.client import normalize_base_url
from tokenmill.bench.common import parse_extra_body
from tokenmill.bench.corpus import ApproxTokenizer, Corpus, read_corpus_text
from tokenmill.bench.errors import BenchError
from tokenmill.bench.record import RequestRecord, TokenChunk, apply_delta, finalize
from tokenmill.bench.stats import metric, peak_rate, percentile_word, summarize, tokens_after_first
from tokenmill.bench.table import pipe_table


def test_population_std_and_summaries():
    m = metric([1.0, 2.0, 3.0, 4.0])
    assert m is not None and m.mean == 2.5 and math.isclose(m.std, math.sqrt(1.25))  # ddof=0
    assert m.fmt() == "2.50 ± 1.12"
    assert metric([]) is None
    s = summarize([0.001, 0.002, 0.003], [99, 99.9], 1000)
    assert s["mean"] == pytest.approx(2.0) and "p99" in s and "p99.9" in s
    assert summarize([], [50], 1000) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p50": 0.0}
    assert percentile_word(90.0) == "90" and percentile_word(99.9) == "99.9"


def test_peak_and_decode_counts():
    ts = [i * 0.01 for i in range(300)]  # 100 tokens per second for 3 s
    assert peak_rate(ts) == pytest.approx(100, abs=1)
    assert peak_rate([0.0, 0.1, 0.2]) == pytest.approx(15)  # a burst under 1 s: over its own span
    assert tokens_after_first([1.0, 1.0, 2.0, 3.0]) == 2


def test_token_count_order_ids_usage_local_chunks():
    def rec(ids: bool, usage: int | None) -> RequestRecord:
        r = RequestRecord(start=0.0)
        for t, text in ((1.0, "ab"), (2.0, "cd"), (3.0, "ef")):
            r.chunks.append(TokenChunk(t, text, [1, 2] if ids else None))
        r.first_token = 1.0
        r.usage_completion = usage
        return r

    by_ids = finalize(rec(True, 99))
    assert by_ids.token_source == "ids" and by_ids.output_tokens == 6
    assert by_ids.token_times == [1.0, 1.0, 1.5, 2.0, 2.5, 3.0]
    by_usage = finalize(rec(False, 5))
    assert by_usage.token_source == "usage" and by_usage.token_times == [1.0, 1.5, 2.0, 2.5, 3.0]
    by_local = finalize(rec(False, None), lambda text: len(text))
    assert by_local.token_source == "local" and by_local.output_tokens == 6
    by_chunks = finalize(rec(False, None))
    assert by_chunks.token_source == "chunks" and by_chunks.output_tokens == 3


def test_stream_chunks_fold_into_a_record():
    r = RequestRecord(start=0.0)
    assert not apply_delta(r, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}, 0.5)
    apply_delta(r, {"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant", "content": "Hi"},
                                                                "token_ids": [5]}]}, 1.0)
    apply_delta(r, {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {
        "name": "f", "arguments": '{"a"'}}]}}]}, 1.1)
    apply_delta(r, {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                                 "finish_reason": "tool_calls"}]}, 1.2)
    assert r.prompt_len(100) == 3 and r.usage_completion == 2 and r.first_response == 1.0
    assert r.calls() == [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert r.finish_reason == "tool_calls" and r.itls() == pytest.approx([0.1, 0.1])


def test_corpus_slices_are_fresh_and_exact():
    text = read_corpus_text()
    assert "OPTICKS" in text and len(text) > 500_000
    tok = ApproxTokenizer()
    sample = "Sir Isaac Newton's Opticks, 1730: light & colours."
    assert tok.decode(tok.encode(sample)) == sample
    corpus = Corpus(tok, seed=3)
    ctx, prompt = corpus.pair(50, 200)
    assert ctx.startswith("[") and corpus.count(ctx) == pytest.approx(200, abs=3)
    assert corpus.count(prompt) == pytest.approx(50, abs=2)
    ctx2, _ = corpus.pair(50, 200)
    assert ctx[:10] != ctx2[:10]  # nonce first: no shared prefix
    _, long = corpus.pair(len(corpus) + 10, 0)  # longer than the corpus: wraps around
    assert corpus.count(long) >= len(corpus)


def test_pipe_table_matches_tabulate_layout():
    assert pipe_table(["model", "test", "t/s"], [["m", "pp2048", "1.00 ± 0.00"]], ["left", "right", "right"]) == (
        "| model   |   test |         t/s |\n"
        "|:--------|-------:|------------:|\n"
        "| m       | pp2048 | 1.00 ± 0.00 |")


def test_option_parsing():
    assert normalize_base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://h:1/v1/") == "http://h:1/v1"
    assert normalize_base_url("http://h/api/openai") == "http://h/api/openai"
    assert parse_extra_body(["temperature=0,top_k:5", "chat_template_kwargs={\"x\": true}", "mode=fast"]) == {
        "temperature": 0, "top_k": 5, "chat_template_kwargs": {"x": True}, "mode": "fast"}
    with pytest.raises(BenchError):
        parse_extra_body(["novalue"])

"""tokenmill's GGUF header parser (gguf_header.py) reads every field and tensor exactly as gguf's
own reader does, in both byte orders; the GGUF tokenizer found without AutoTokenizer's legacy
parse is the tokenizer AutoTokenizer builds."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from tokenmill.models.gguf_header import read_gguf_header
from tokenmill.models.loader import CheckpointSource, _gguf_tokenizer_class, load_tokenizer

NESTED = {"test.nested": [[1, 2], [3]]}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def assert_same_reading(path: Path) -> None:
    ours, theirs = read_gguf_header(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        if key in NESTED:
            assert ours.fields[key] == NESTED[key]  # gguf's contents() flattens nested arrays
            continue
        assert repr(ours.fields[key]) == repr(field.contents()), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for b in theirs.tensors:
        a = ours.tensors[b.name]
        assert (a.tensor_type, a.data_offset, a.n_bytes, list(a.shape)) == (b.tensor_type, b.data_offset, b.n_bytes,
                                                                           list(b.shape)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("order", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little-endian", "big-endian"])
def test_every_kind_of_field_and_tensor_reads_the_same(tmp_path: Path, order: gguf.GGUFEndian) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=order)
    writer.add_block_count(2)
    writer.add_string("test.text", "naïve ☃ text")
    writer.add_array("test.strings", ["a", "", "bc", "✓" * 7])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_bool("test.flag", True)
    writer.add_float64("test.f64", 2.5)
    writer.add_uint64("test.u64", 2**40)
    writer.add_float32("test.f32", 1e-5)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 65535)
    writer.add_array("test.nested", NESTED["test.nested"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(path)


@pytest.mark.slow
def test_the_real_model_reads_the_same(smollm2_path: Path) -> None:
    assert_same_reading(smollm2_path)


@pytest.mark.slow
def test_gguf_tokenizer_is_the_one_autotokenizer_builds(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    source = CheckpointSource(smollm2_path.parent, smollm2_path)
    assert _gguf_tokenizer_class(source) is not None  # the fast path is taken
    ours = load_tokenizer(source)
    theirs = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.init_kwargs == theirs.init_kwargs
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.chat_template == theirs.chat_template
    assert ours.all_special_tokens == theirs.all_special_tokens
    text = "Hello, wörld! <|im_start|>user\n  tabs\tand 12345"
    assert ours(text).input_ids == theirs(text).input_ids


def test_files_beside_a_gguf_leave_the_choice_to_autotokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert _gguf_tokenizer_class(CheckpointSource(tmp_path, tmp_path / "m.gguf")) is None

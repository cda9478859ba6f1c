"""A GGUF file's header, parsed in one pass: its metadata as Python values and its tensor table.

gguf's own reader builds a numpy view for every part of every field, hundreds of thousands of
them for a vocabulary, and takes most of a second on a small model; this reads the same bytes
with `struct` and yields what `ReaderField.contents()` and `ReaderTensor` give (tests/models/
test_gguf_reader.py compares the two on every kind of field and tensor; an array of arrays keeps
its nesting, which contents() flattens). Both byte orders, GGUF versions 2 and 3, as gguf reads
them.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_V = GGUFValueType
_FORMATS: dict[GGUFValueType, str] = {
    _V.UINT8: "B", _V.INT8: "b", _V.UINT16: "H", _V.INT16: "h", _V.UINT32: "I", _V.INT32: "i",
    _V.FLOAT32: "f", _V.BOOL: "?", _V.UINT64: "Q", _V.INT64: "q", _V.FLOAT64: "d",
}
_Q = GGMLQuantizationType
# Types whose data gguf shows as elements; every other type is shown as bytes per row.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type] = {
    _Q.F16: np.float16, _Q.F32: np.float32, _Q.F64: np.float64,
    _Q.I8: np.int8, _Q.I16: np.int16, _Q.I32: np.int32, _Q.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: `shape` in GGUF order (innermost first), `data` a view of the file,
    shaped as gguf's ReaderTensor.data is (elements, or bytes per row for block-quantized types)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer: memoryview, order: str) -> None:
        self.buffer, self.order, self.at = buffer, order, 0
        self._structs: dict[str, struct.Struct] = {}

    def scalar(self, fmt: str) -> Any:
        packed = self._structs.get(fmt)
        if packed is None:
            packed = self._structs[fmt] = struct.Struct(self.order + fmt)
        (value,) = packed.unpack_from(self.buffer, self.at)
        self.at += packed.size
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.at + length
        if end > len(self.buffer):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = str(self.buffer[self.at:end], "utf-8")
        self.at = end
        return text

    def value(self, value_type: int) -> Any:
        kind = GGUFValueType(value_type)
        if kind == _V.STRING:
            return self.string()
        if kind != _V.ARRAY:
            return self.scalar(_FORMATS[kind])
        item_type = GGUFValueType(self.scalar("I"))
        count = self.scalar("Q")
        if item_type in (_V.STRING, _V.ARRAY):
            return [self.value(item_type) for _ in range(count)]
        dtype = np.dtype(_FORMATS[item_type]).newbyteorder(self.order)
        items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.at)
        self.at += dtype.itemsize * count
        return items.tolist()


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at `path` (ValueError, struct.error or
    UnicodeDecodeError on bytes that are not a GGUF file)."""
    # copy-on-write: writable views (torch takes them without a warning), the file untouched
    data = np.memmap(path, mode="c").view(np.ndarray)
    buffer = memoryview(data)
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    native = "<" if sys.byteorder == "little" else ">"
    cursor = _Cursor(buffer, native)
    cursor.at = 4
    version = cursor.scalar("I")
    if version & 0xFFFF == 0:  # written in the other byte order
        cursor.order = ">" if native == "<" else "<"
        cursor._structs.clear()
        cursor.at = 4
        version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} (this reader handles {SUPPORTED_VERSIONS})")
    tensor_count, field_count = cursor.scalar("Q"), cursor.scalar("Q")
    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count,
                              "GGUF.kv_count": field_count}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        shape = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
        table.append((name, GGMLQuantizationType(cursor.scalar("I")), shape, cursor.scalar("Q")))
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
    start = -(-cursor.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, tensor_type, shape, offset in table:
        if name in tensors:
            raise ValueError(f"duplicated tensor {name!r}")
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(shape, dtype=np.int64))
        n_bytes = n_elements * type_size // block_size
        numpy_shape = tuple(reversed(shape))
        element = _ELEMENT_DTYPES.get(tensor_type)
        if element is None:
            dtype, count, numpy_shape = np.dtype(np.uint8), n_bytes, quant_shape_to_byte_shape(numpy_shape, tensor_type)
        else:
            dtype, count = np.dtype(element).newbyteorder(cursor.order), n_elements
        at = start + offset
        if at + dtype.itemsize * count > len(data):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensor_data = data[at:at + dtype.itemsize * count].view(dtype).reshape(numpy_shape)
        tensors[name] = GGUFTensor(name, tensor_type, shape, n_bytes, at, tensor_data)
    return GGUFHeader(fields, tensors)

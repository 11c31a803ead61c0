"""The safetensors file format, for writing one tensor at a time.

A safetensors file is an 8-byte little-endian header length ``N``, then ``N`` bytes of
JSON (padded with spaces to a multiple of 8), then the tensors' bytes, C order,
little-endian, back to back with no gaps. The header maps each tensor's name to
``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (offsets into the data
that follows the header) and may hold ``"__metadata__"``: a map of strings to strings.
Because the header states every offset, it can be written before any tensor is read,
and the tensors then streamed in order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from distckpt.errors import ConversionError

#: distckpt dtype names and their safetensors names. complex128 has none.
DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
}
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # distckpt's name
    shape: tuple[int, ...]
    nbytes: int


def safetensors_dtype(dtype: str, name: str) -> str:
    """The safetensors name of a distckpt dtype; refuses those safetensors lacks."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConversionError(
            f"variable {name!r}: safetensors has no dtype for {dtype}; export to .pt instead"
        ) from None


def header(tensors: Sequence[TensorHeader], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for ``tensors``, whose data follow in this order."""
    doc: dict[str, object] = {}
    if metadata:
        doc[METADATA_KEY] = metadata
    offset = 0
    for t in tensors:
        if t.name == METADATA_KEY:
            raise ConversionError(f"a tensor named {METADATA_KEY!r} cannot go in safetensors")
        doc[t.name] = {
            "dtype": safetensors_dtype(t.dtype, t.name),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text

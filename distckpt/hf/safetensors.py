"""The safetensors file format: reading a file's header, and writing one.

A safetensors file is an 8-byte little-endian header length ``N``, then ``N`` bytes of
JSON (padded with spaces), then the tensors' bytes, C order, little-endian, back to back.
The header maps each tensor's name to ``{"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]}`` (offsets into the data that follows the header) and may hold
``"__metadata__"``: a map of strings to strings. Because the header states every offset,
a reader can read any box of any tensor with ranged reads, and a writer can write the
header before any tensor and then the tensors in any order.

Headers are untrusted input: :func:`read_header` checks the length, the JSON, every
dtype, shape and offset against the file's size, and that no two tensors overlap, and
names the file and the entry in its error. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distckpt import dtypes
from distckpt.errors import ConversionError, CorruptCheckpointError
from distckpt.storage.beneath import open_resolved

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
FROM_SAFETENSORS = {v: k for k, v in DTYPES.items()}
METADATA_KEY = "__metadata__"
#: The largest header accepted (the safetensors library's own limit).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # distckpt's name
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file: its bytes are ``[offset, offset + nbytes)`` of
    ``path`` (offsets from the start of the file), C order."""

    name: str
    path: str
    dtype: str  # distckpt's name
    shape: tuple[int, ...]
    offset: int
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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"the name {key!r} appears twice")
        doc[key] = value
    return doc


def read_header(path: str | os.PathLike[str]) -> tuple[list[StoredTensor], dict[str, str]]:
    """Every tensor of the safetensors file at ``path`` (in file order) and its
    ``__metadata__``, checked against the file (see the module doc); reads the header only.
    ``path`` is where the file leads, as :func:`~distckpt.hf.directory.open_weights`
    resolved and checked it: a link on it now is refused, never followed.
    """
    path = os.fspath(path)
    try:
        with os.fdopen(open_resolved(path), "rb") as f:  # as open_weights checked it
            size = os.fstat(f.fileno()).st_size
            length = header_length(path, f.read(8), size)
            raw = f.read(length)
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such file") from None
    return parse_header(path, raw, size)


def header_length(path: str, prefix: bytes, size: int) -> int:
    """The header's length, from the file's first 8 bytes, checked against its ``size``."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CorruptCheckpointError(
            f"{path}: not a safetensors file (header length {length} for a file of {size} bytes)"
        )
    return int(length)


def parse_header(path: str, raw: bytes, size: int) -> tuple[list[StoredTensor], dict[str, str]]:
    """The tensors and metadata of the header ``raw`` of the file ``path`` of ``size``
    bytes (see :func:`read_header`)."""
    length = len(raw)
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: the safetensors header is not a JSON object")
    metadata = doc.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpointError(f"{path}: {METADATA_KEY} is not a map of strings to strings")
    start = 8 + length
    tensors = [_entry(path, name, spec, start, size) for name, spec in doc.items()]
    tensors.sort(key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(tensors, tensors[1:]):
        if a.offset + a.nbytes > b.offset:
            raise CorruptCheckpointError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    return tensors, metadata


def _entry(path: str, name: str, spec: Any, start: int, size: int) -> StoredTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict):
        raise CorruptCheckpointError(f"{where}: its header entry is not an object")
    named = spec.get("dtype")
    dtype = FROM_SAFETENSORS.get(named) if isinstance(named, str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{where}: dtype {named!r} is not one distckpt reads ("
            + ", ".join(sorted(FROM_SAFETENSORS))
            + ")"
        )
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise CorruptCheckpointError(f"{where}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
    ):
        raise CorruptCheckpointError(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    if not 0 <= begin <= end or end - begin != nbytes or start + end > size:
        raise CorruptCheckpointError(
            f"{where}: data_offsets {offsets} do not hold {nbytes} bytes of {dtype} {shape} "
            f"within the file's {size - start} bytes of data"
        )
    return StoredTensor(name, path, dtype, tuple(shape), start + begin, nbytes)

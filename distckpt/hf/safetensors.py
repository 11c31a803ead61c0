"""The safetensors file format: reading a file's header, and writing one.

A safetensors file is an 8-byte little-endian header length ``N``, then ``N`` bytes of
JSON (padded with spaces), then the tensors' bytes, C order, little-endian, back to back.
The header maps each tensor's name to ``{"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]}`` (offsets into the data that follows the header) and may hold
``"__metadata__"``: a map of strings to strings. Because the header states every offset,
a reader can read any box of any tensor with ranged reads, and a writer can write the
header before any tensor and then the tensors in any order.

Headers are untrusted input: :func:`read_header` checks the length (at most
:data:`MAX_HEADER_BYTES`, before reading it), the JSON, every dtype, shape and offset
against the file's size, and that no two tensors overlap, and names the file and the
entry in its error. The header is read at a bounded cost (:mod:`distckpt.hf.bounded_json`,
never ``json.loads`` of the whole): at most :data:`MAX_TENSORS` tensors, each shape of at
most 64 dimensions (:data:`MAX_DIMS` in all), each checked as it is read, before anything
is computed from it; names of at most 64 KiB, metadata strings of at most 16 MiB.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distckpt import dtypes
from distckpt.errors import ConversionError, CorruptCheckpointError
from distckpt.format.wellformed import MAX_BYTES, MAX_NDIM
from distckpt.hf.bounded_json import MAX_KEY_BYTES, MAX_STRING_BYTES, Scanner
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
#: Tensors a header may hold (a model of 100,000 tensors in one file fits).
MAX_TENSORS = 1 << 17
#: Dimensions of all the shapes in a header together (four a tensor, at the most tensors).
MAX_DIMS = 4 * MAX_TENSORS
#: Bytes that a header's names and metadata may take in memory beyond the header's own
#: (a name of ASCII with one emoji takes four bytes a character).
MAX_EXPANSION = 16 << 20
#: Fields of a tensor's entry besides dtype, shape and data_offsets (skipped, bounded).
MAX_EXTRA_FIELDS = 8
_FIELDS = ("dtype", "shape", "data_offsets")
# A tensor's name and entry as safetensors writes them: matched whole (bounded repeats of
# one character class, no backtracking to speak of) and read without a step per token.
# _NAME and _FIELD read the parts of an entry written otherwise (fields in another order,
# other whitespace); only escapes and unknown fields are read a token at a time.
_W = rb"[ \t\n\r]*"
_NUM = rb"(?:0|[1-9][0-9]{0,19})"
_COUNTS = rb"((?:%s(?:%s,%s%s){0,%d})?)" % (_NUM, _W, _W, _NUM, MAX_NDIM - 1)
_NAME_TEXT = rb'"([^"\\\x00-\x1f]{0,%d})"' % MAX_KEY_BYTES
_ENTRY = re.compile(
    _W + _NAME_TEXT + _W + rb":" + _W + rb"\{" + _W
    + rb'"dtype"' + _W + rb":" + _W + rb'"([A-Z0-9_]{1,16})"' + _W + rb"," + _W
    + rb'"shape"' + _W + rb":" + _W + rb"\[" + _W + _COUNTS + _W + rb"\]" + _W + rb"," + _W
    + rb'"data_offsets"' + _W + rb":" + _W + rb"\[" + _W
    + rb"(%s)%s,%s(%s)" % (_NUM, _W, _W, _NUM)
    + _W + rb"\]" + _W + rb"\}" + _W + rb"([,}]?)"
)  # fmt: skip
_NAME = re.compile(_W + _NAME_TEXT + _W + rb":")
_FIELD = re.compile(
    _W + rb'"(dtype|shape|data_offsets)"' + _W + rb":" + _W
    + rb'(?:"([A-Z0-9_]{1,16})"|\[' + _W + _COUNTS + _W + rb"\])" + _W + rb"([,}]?)"
)  # fmt: skip


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
    bytes (see :func:`read_header`), read at a bounded cost
    (:mod:`distckpt.hf.bounded_json`): every count is checked as it is read."""
    scan = Scanner(raw, path, "the safetensors header")
    if not scan.take("{"):
        raise scan.fail("the safetensors header is not a JSON object")
    start = 8 + len(raw)
    tensors: list[StoredTensor] = []
    names: set[str] = set()
    metadata: dict[str, str] | None = None
    dims = 0
    kept = 0  # bytes of the names and metadata kept (bounded by the header's own)
    closed = scan.take("}")  # an empty header
    while not closed:
        fast = _ENTRY.match(raw, scan.pos)
        if fast is not None:  # as safetensors writes it: read in one match
            scan.pos = fast.end()
            name = scan.utf8(fast[1], "a tensor's name")
            fields = (fast[2].decode("ascii"), _ints(fast[3]), [int(fast[4]), int(fast[5])])
        elif (head := _NAME.match(raw, scan.pos)) is not None:
            scan.pos = head.end()
            name = scan.utf8(head[1], "a tensor's name")
        else:
            name = scan.string(MAX_KEY_BYTES, "a tensor's name")
            scan.expect(":")
        if name in names or (name == METADATA_KEY and metadata is not None):
            raise scan.fail(f"the name {name!r} appears twice in the safetensors header")
        if name == METADATA_KEY:
            if fast is not None:
                raise scan.fail(f"{METADATA_KEY} is not a map of strings to strings")
            metadata = _metadata(scan)
            kept += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in metadata.items())
        elif len(tensors) == MAX_TENSORS:
            raise scan.fail(f"the safetensors header holds more than {MAX_TENSORS} tensors")
        else:
            if fast is None:
                fields = _fields(scan, name)
            tensor = _tensor(scan, path, name, *fields, start, size)
            dims += len(tensor.shape)
            if dims > MAX_DIMS:
                raise scan.fail(
                    f"the safetensors header's shapes have more than {MAX_DIMS} dimensions in all"
                )
            names.add(name)
            tensors.append(tensor)
            kept += sys.getsizeof(name)
        if kept > len(raw) + MAX_EXPANSION:
            raise scan.fail("the safetensors header's names take more memory than its bytes")
        closed = scan.member_end(None if fast is None else fast[6], "the safetensors header")
    scan.end()
    tensors.sort(key=lambda t: (t.offset, t.nbytes))
    for a, b in zip(tensors, tensors[1:]):
        if a.offset + a.nbytes > b.offset:
            raise CorruptCheckpointError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    return tensors, metadata or {}


def _metadata(scan: Scanner) -> dict[str, str]:
    """``__metadata__``: null or a map of strings to strings."""
    if scan.peek() == "n":
        scan.skip(METADATA_KEY)
        return {}
    bad = scan.fail(f"{METADATA_KEY} is not a map of strings to strings")
    if scan.peek() != "{":
        raise bad
    metadata: dict[str, str] = {}
    for key in scan.keys(MAX_TENSORS, METADATA_KEY):
        if scan.peek() != '"' or key in metadata:
            raise bad
        metadata[key] = scan.string(MAX_STRING_BYTES, f"{METADATA_KEY}[{key!r}]")
    return metadata


def _fields(scan: Scanner, name: str) -> tuple[str, list[int], list[int]]:
    """One tensor's entry, in any form JSON allows: its dtype, shape (at most
    :data:`MAX_NDIM` dimensions) and data_offsets, each checked as it is read. A field
    written plainly is read in one match; others (escapes, other fields) step by step."""
    where = f"tensor {name!r}"
    if not scan.take("{"):
        raise scan.fail(f"{where}: its header entry is not an object")
    fields: dict[str, Any] = {}
    closed = scan.take("}")
    while not closed:
        if len(fields) == len(_FIELDS) + MAX_EXTRA_FIELDS:
            raise scan.fail(f"{where}: its header entry has more than {len(fields)} fields")
        plain = _FIELD.match(scan.raw, scan.pos)
        if plain is not None:
            scan.pos = plain.end()
            key = plain[1].decode("ascii")
            value: Any = plain[2].decode("ascii") if plain[2] is not None else _ints(plain[3])
        else:
            key = scan.string(MAX_KEY_BYTES, f"a field of {where}")
            scan.expect(":")
            value = _field(scan, where, key)
        if key in fields:
            raise scan.fail(f"{where}: {key!r} appears twice in its header entry")
        fields[key] = value
        if plain is not None and plain[4]:
            closed = plain[4] == b"}"
        else:
            closed = scan.take("}")
            if not closed and not scan.take(","):
                raise scan.bad(f"expected ',' or '}}' in the entry of {where}")
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        raise scan.fail(f"{where}: its header entry has no {', '.join(missing)}")
    named, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if not isinstance(named, str):
        raise _unknown_dtype(scan, where, str(named))
    if not isinstance(shape, list) or not isinstance(offsets, list):
        raise scan.fail(f"{where}: bad shape {shape!r} or data_offsets {offsets!r}")
    return named, shape, offsets


def _field(scan: Scanner, where: str, key: str) -> Any:
    """The value of the field ``key`` of a tensor's entry, read step by step."""
    if key == "shape":
        return scan.counts(MAX_NDIM, f"{where}: bad shape", "dimensions")
    if key == "data_offsets":
        return scan.counts(2, f"{where}: bad data_offsets")
    if key == "dtype":
        if scan.peek() != '"':
            raise _unknown_dtype(scan, where, scan.skip(f"{where}: its dtype"))
        return scan.string(64, f"{where}: its dtype")
    scan.skip(f"{where}: its {key!r}")  # another field: safetensors ignores them too
    return None


def _ints(text: bytes) -> list[int]:
    return [int(n) for n in text.split(b",")] if text else []


def _tensor(
    scan: Scanner,
    path: str,
    name: str,
    named: str,
    shape: list[int],
    offsets: list[int],
    start: int,
    size: int,
) -> StoredTensor:
    """The tensor of an entry, checked against the file's ``size`` (data from ``start``)."""
    where = f"tensor {name!r}"
    dtype = FROM_SAFETENSORS.get(named)
    if dtype is None:
        raise _unknown_dtype(scan, where, repr(named))
    itemsize = dtypes.itemsize(dtype)
    nbytes = math.prod(shape) * itemsize
    # Dimensions of zero leave the product at zero, but torch still multiplies the others
    # into strides: their product must be one a tensor can have.
    if nbytes == 0 and math.prod(n for n in shape if n) * itemsize > MAX_BYTES:
        raise scan.fail(f"{where}: the shape {shape} is impossibly large")
    if len(offsets) != 2:
        raise scan.fail(f"{where}: bad data_offsets {offsets} (not [begin, end])")
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != nbytes or start + end > size:
        raise scan.fail(
            f"{where}: data_offsets {offsets} do not hold {nbytes} bytes of {dtype} {shape} "
            f"within the file's {size - start} bytes of data"
        )
    return StoredTensor(name, path, dtype, tuple(shape), start + begin, nbytes)


def _unknown_dtype(scan: Scanner, where: str, named: str) -> CorruptCheckpointError:
    known = ", ".join(sorted(FROM_SAFETENSORS))
    return scan.fail(f"{where}: dtype {named} is not one distckpt reads ({known})")

"""What a reader checks of an index entry before trusting it: types, ranks, bounds, and
sizes against what is stored. Pure: no I/O.

Everything in an index, a manifest or a pointer is read as hostile. The checks here turn
any malformed entry into one :class:`~distckpt.errors.CorruptCheckpointError` naming the
variable, before any of it is used to open a file or allocate memory:

* names of files are relative keys that stay inside the checkpoint
  (:func:`~distckpt.storage.backend.check_key`);
* numbers are ints (never bools, floats or strings) in range: shapes and boxes of at
  most :data:`MAX_NDIM` dimensions and :data:`MAX_BYTES` bytes, boxes inside the shape,
  blocks holding their box, inner chunks dividing their block;
* a piece's declared contents fit its stored size (:func:`check_piece`): a plain chunk is
  exactly its block's bytes and a crc32c; a shard holds at least its checksum table and
  index and, raw, at most every inner chunk in full; a compressed piece decompresses to
  at most :data:`MAX_RATIO` times its stored bytes, each inner chunk to at most
  :data:`MAX_CODEC_CHUNK`. Readers compare the stored size with
  the file's before reading, so every buffer a reader allocates is bounded by what is
  stored.
"""

from __future__ import annotations

import math
from typing import Any

from distckpt.errors import CorruptCheckpointError, UnsafePathError
from distckpt.storage.backend import check_key

#: Dimensions a stored tensor may have (NumPy's limit).
MAX_NDIM = 64
#: Bytes a stored tensor or piece may declare (indexing is int64 in NumPy and torch).
MAX_BYTES = 1 << 62
#: A compressed piece decompresses to at most this many times its stored bytes. zstd's
#: densest encoding (runs of one byte) stays under 1:32768, blosc's LZ4 under 1:256; a
#: declared size beyond this is corrupt, and no reader allocates for it.
MAX_RATIO = 1 << 16
#: A compressed inner chunk decompresses to at most this many bytes (saves refuse larger
#: ``inner_bytes`` with compression): a reader decompresses a chunk whole, so this bounds
#: what one decode allocates, however little is stored.
MAX_CODEC_CHUNK = 64 << 20
#: Bytes of a shard's bookkeeping per inner chunk: its checksum table entry (4) and its
#: index entry (16); the index's own crc32c adds 4 per shard.
SHARD_BYTES_PER_CHUNK = 20
#: What a signed save's shard adds per inner chunk (its row of the hash table).
HASH_BYTES = 32


def corrupt(variable: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"variable {variable!r}: {what}")


def check_variable_name(variable: str) -> None:
    """A stored variable name is text: a lone surrogate (which JSON's ``\\ud800`` escape
    reads as) names nothing a save could have named, and no file or header encodes it."""
    try:
        variable.encode("utf-8")
    except UnicodeEncodeError:
        raise corrupt(variable, "its name is not text (it holds a lone surrogate)") from None


def count(value: Any) -> bool:
    """Whether ``value`` is a non-negative int (a bool is not)."""
    return type(value) is int and 0 <= value < MAX_BYTES


def counts(value: Any, variable: str, what: str, *, ndim: int | None = None) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (of ``ndim`` entries, when given)."""
    if not isinstance(value, list) or not all(count(v) for v in value):
        raise corrupt(variable, f"the index's {what} is not a list of counts: {_short(value)}")
    if len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        raise corrupt(
            variable,
            f"the index's {what} {_short(value)} has {len(value)} dimensions, "
            f"not {ndim if ndim is not None else f'at most {MAX_NDIM}'}",
        )
    return tuple(value)


def box_of(
    value: Any, variable: str, shape: tuple[int, ...] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and lengths of a stored box ``[offsets, lengths]``; with ``shape``,
    checked to be of its rank and to lie inside it."""
    if not isinstance(value, list) or len(value) != 2:
        raise corrupt(variable, f"a box that is not [offsets, lengths]: {_short(value)}")
    ndim = None if shape is None else len(shape)
    offsets = counts(value[0], variable, "box offsets", ndim=ndim)
    lengths = counts(value[1], variable, "box lengths", ndim=len(offsets))
    if shape is not None:
        check_inside(variable, shape, offsets, lengths)
    return offsets, lengths


def check_inside(
    variable: str, shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> None:
    if any(o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise corrupt(variable, f"a box that lies outside the shape {list(shape)}")


def shape_of(entry: dict[str, Any], variable: str, itemsize: int) -> tuple[int, ...]:
    """A tensor entry's declared shape, checked to be one of at most :data:`MAX_BYTES`,
    its dimensions of zero left out: they leave the product at zero, but NumPy and torch
    still multiply the others into strides (as for safetensors, :mod:`distckpt.hf`)."""
    shape = counts(entry.get("shape"), variable, "shape")
    if math.prod(n for n in shape if n) * itemsize > MAX_BYTES:
        raise corrupt(variable, f"the declared shape {list(shape)} is impossibly large")
    return shape


def check_piece(
    variable: str,
    file: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    block: tuple[int, ...],
    inner: tuple[int, ...] | None,
    size: int,
    itemsize: int,
    compressed: bool,
    hashed: bool = False,
) -> None:
    """Check one stored piece against its variable's ``shape`` and its own stored ``size``
    (see the module; ``hashed``: a shard with a hash table, a signed save's); raises
    :class:`CorruptCheckpointError` naming the file."""
    ndim = len(shape)

    def bad(what: str) -> CorruptCheckpointError:
        return corrupt(variable, f"piece {file}: {what}")

    if len(offsets) != ndim or len(lengths) != ndim or len(block) != ndim:
        raise bad(f"a box or block of another rank than the shape {list(shape)}")
    try:
        check_inside(variable, shape, offsets, lengths)
    except CorruptCheckpointError:
        raise bad(f"its box lies outside the shape {list(shape)}") from None
    if any(b < n for b, n in zip(block, lengths)):
        raise bad(f"its block {list(block)} does not hold its box")
    if inner is not None and len(inner) != ndim:
        raise bad(f"inner chunks {list(inner)} of another rank than the shape {list(shape)}")
    if math.prod(lengths) == 0:
        return  # nothing stored, nothing read
    data = math.prod(block) * itemsize
    if data > MAX_BYTES:
        raise bad(f"its block {list(block)} is impossibly large")
    if inner is None:
        if compressed:
            raise bad("a plain chunk with a codec")
        if size != data + 4:
            raise bad(f"a plain chunk of {data} bytes stored in {size}")
        return
    if len(inner) != ndim or any(i <= 0 or b % i for b, i in zip(block, inner)):
        raise bad(f"inner chunks {list(inner)} do not divide the block {list(block)}")
    chunks = math.prod(b // i for b, i in zip(block, inner))
    least = (SHARD_BYTES_PER_CHUNK + (HASH_BYTES if hashed else 0)) * chunks + 4
    most = least + chunks * (math.prod(inner) * itemsize + 4)
    if size < least or (not compressed and size > most):
        raise bad(f"{chunks} inner chunks cannot be stored in {size} bytes")
    if compressed and data > size * MAX_RATIO:
        raise bad(f"{data} bytes cannot decompress from {size}")
    if compressed and math.prod(inner) * itemsize > max(MAX_CODEC_CHUNK, itemsize):
        raise bad(
            f"compressed inner chunks {list(inner)} of {math.prod(inner) * itemsize} bytes "
            f"(at most {MAX_CODEC_CHUNK} are ever written)"
        )


def check_file(file: Any, variable: str) -> str:
    """A piece's file name: a key inside the checkpoint."""
    try:
        return check_key(file, "file")
    except UnsafePathError as exc:
        raise UnsafePathError(f"variable {variable!r}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

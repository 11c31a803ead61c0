"""Writing the bytes of one stored piece, in zarr v3's own formats (read back by
:mod:`distckpt.format.piece_reader`).

A *piece* is one file holding one box of a variable. Two formats, both zarr v3:

* **sharded** (``sharding_indexed`` codec, index at the end): the piece's block is cut
  into inner chunks (1 MiB by default), each stored as its raw little-endian bytes followed by
  its crc32c; then the shard index (per inner chunk, in C order: offset and length as
  little-endian uint64, both ``2**64-1`` for a chunk that is absent) and the index's own
  crc32c. A reader fetches the index, then only the inner chunks it needs.
  distckpt also puts a *checksum table* at the start of the file, where zarr readers
  never look (the shard index does not point there): the crc32c of every inner chunk as
  little-endian uint32, in C order, 0 for an absent one.
* **plain**: the whole chunk's bytes followed by their crc32c (codecs ``bytes`` +
  ``crc32c``), for small arrays. Plain chunks are never compressed.

A sharded piece may be **compressed** (:mod:`distckpt.format.codecs`): each inner chunk
is then stored as its compressed bytes followed by the crc32c *of those compressed
bytes* (codecs ``bytes`` + ``zstd``/``blosc`` + ``crc32c``), the shard index records each
chunk's own length, and the checksum table holds the same crc32c values. Inner chunks are
compressed independently and a reader decompresses only the chunks it needs, each into a
buffer of one inner chunk.

Inner chunks are written independently too (:class:`ShardFile`): a save's I/O workers
write ranges of them at once, each at its own offset.

The checkpoint index records one crc32c per piece: of the checksum table for a shard, of
the data for a plain chunk. Both depend on the data, so a file swapped for another of the
same shape, truncated, or damaged is caught before its bytes are used, and a reader that
needs one inner chunk still verifies it against the index without reading the others.

**Hashed pieces** (a signed save's, :mod:`distckpt.signing`): a shard then also holds a
*hash table* right after the checksum table, where zarr readers never look either: the
32-byte hash (:mod:`distckpt.signing.hashes`) of every inner chunk's stored bytes and
the crc32c after them, in C order, zeros for an absent one; chunks start after it. The
piece's hash, which the index records, is the hash of the checksum table, the hash table
and the shard index with its crc32c, one after the other: every byte of the file is
covered, and a reader that needs one inner chunk verifies it against the signed index by
reading the tables, the shard index and that chunk. A plain chunk's hash is the hash of
the whole file.
"""

from __future__ import annotations

import itertools
import math
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import crc32c as _crc
import numpy as np

from distckpt.format import digests
from distckpt.format.codecs import Codec
from distckpt.signing import hashes
from distckpt.storage.backend import Store, WriteHandle, write_whole

EMPTY = 2**64 - 1
#: Bytes read per system call when reading an inner chunk: small enough that the checksum
#: of each step runs on data still in the CPU cache.
STEP = 1 << 20


def _view(data: np.ndarray | bytes | bytearray | memoryview) -> memoryview:
    return data.data if isinstance(data, np.ndarray) else memoryview(data)


def crc32c(data: np.ndarray | bytes | bytearray | memoryview, value: int = 0) -> int:
    """The crc32c of ``data``, continuing from ``value`` (the crc32c of what came before)."""
    return int(_crc.crc32c(_view(data), value))


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, ml_dtypes included)."""
    return array.reshape(-1).view(np.uint8)


class Stored(NamedTuple):
    """What writing one piece stored: the file's bytes, its crc (of the checksum table
    for a shard, of the data for a plain chunk) and, when asked, the content digest of
    its data (:mod:`distckpt.format.digests`)."""

    size: int
    crc: int
    digest: bytes | None = None
    #: Where the file was taken from instead of written (an incremental save's base).
    reused: str | None = None
    #: Each inner chunk's digest, in shard-index order (kept in memory, not in the index).
    chunks: tuple[bytes, ...] | None = None
    #: What the store says of the file once written (:meth:`CopyingStore.stamp`): a later
    #: copy of it checks that it was not rewritten since (kept in memory).
    stamp: str | None = None
    #: The piece's cryptographic hash (a signed save's; see the module docstring).
    hash: bytes | None = None


def inner_grid(block: Sequence[int], inner: Sequence[int]) -> tuple[int, ...]:
    return tuple(b // i for b, i in zip(block, inner, strict=True))


class ChunkPart(NamedTuple):
    """One inner chunk of a shard that holds data, and where that data comes from.

    ``offsets`` is the chunk's origin in block coordinates, and the data it holds is the
    box of ``lengths`` from there (the piece's data starts at the block's origin); that
    part is smaller than the chunk (``whole`` False) only at the edge of the array, where
    the rest of the chunk is zeros. ``start`` is the byte offset of the part in the data's C order
    when the part is one contiguous run of it (always, for the inner chunks distckpt
    plans), else None. Plain tuples: a shard of a large tensor has thousands of these.
    """

    linear: int  # position in the shard index (C order over the inner grid)
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    whole: bool
    start: int | None
    nbytes: int  # bytes of the part

    @property
    def end(self) -> int | None:
        return None if self.start is None else self.start + self.nbytes

    @property
    def slices(self) -> Any:
        """The part's index into the data (ends with ``...``: a view even when 0-d)."""
        return (*(slice(a, a + n) for a, n in zip(self.offsets, self.lengths, strict=True)), ...)


def chunk_parts(
    data_shape: Sequence[int], block: Sequence[int], inner: Sequence[int], itemsize: int
) -> list[ChunkPart]:
    """The inner chunks of a shard that meet data of ``data_shape``, in C order.

    Together their parts cover the data exactly once; for inner chunks that split only
    leading dimensions (:func:`distckpt.planning.layout.inner_chunks`) the parts are
    consecutive runs of the data's bytes, in order.
    """
    data_shape = tuple(data_shape)
    grid = inner_grid(block, inner)
    ndim = len(data_shape)
    grid_strides = [math.prod(grid[d + 1 :]) for d in range(ndim)]
    data_strides = [math.prod(data_shape[d + 1 :]) * itemsize for d in range(ndim)]
    per_dim = [  # (linear step, chunk origin, part length) of each chunk meeting the data
        [(c * grid_strides[d], c * size, min(size, n - c * size)) for c in range(-(-n // size))]
        for d, (n, size) in enumerate(zip(data_shape, inner, strict=True))
    ]
    inner_t = tuple(inner)
    parts: list[ChunkPart] = []
    for combo in itertools.product(*per_dim):
        offsets = tuple(e[1] for e in combo)
        lengths = tuple(e[2] for e in combo)
        nbytes = math.prod(lengths) * itemsize
        parts.append(
            ChunkPart(
                sum(e[0] for e in combo),
                offsets,
                lengths,
                lengths == inner_t,
                _run_start(offsets, lengths, data_shape, data_strides),
                nbytes,
            )
        )
    return parts


def _run_start(
    at: tuple[int, ...],
    lengths: tuple[int, ...],
    data_shape: tuple[int, ...],
    data_strides: list[int],
) -> int | None:
    """Byte offset of the box (``at``, ``lengths``) in C-ordered data of ``data_shape``
    if the box is one contiguous run of it, else None."""
    first = next((d for d, n in enumerate(lengths) if n > 1), len(lengths) - 1)
    for d in range(first + 1, len(lengths)):
        if at[d] != 0 or lengths[d] != data_shape[d]:
            return None
    return sum(a * s for a, s in zip(at, data_strides, strict=True))


def stored_chunk(
    data: np.ndarray, chunk: ChunkPart, inner: Sequence[int], scratch: np.ndarray
) -> np.ndarray:
    """The stored (raw, C-ordered) bytes of ``chunk`` (of shape ``inner``), given
    ``data``, its part's values.

    A whole chunk whose data is contiguous is returned without a copy; otherwise the
    chunk is assembled in ``scratch`` (flat uint8, at least one chunk), zeros around the
    part."""
    if chunk.whole and data.flags.c_contiguous:
        return as_bytes(data)
    shape = tuple(inner)
    nbytes = math.prod(shape) * data.dtype.itemsize
    out = scratch[:nbytes]
    if not chunk.whole:
        out.fill(0)
    within: Any = (*(slice(0, n) for n in chunk.lengths), ...)  # from the chunk's origin
    out.view(data.dtype).reshape(shape)[within] = data
    return out


class ShardFile:
    """One shard file, written an inner chunk at a time, by several threads at once.

    Raw chunks have fixed offsets (after the checksum table, in C order), so they can be
    written in any order. A compressed chunk's offset is reserved when its compressed size
    is known, so chunks land in the order they finish (the shard index records every
    offset; zarr readers follow it). :meth:`finish` writes the shard index at the end and
    the checksum table at the start, fsyncs and closes.
    """

    def __init__(
        self,
        handle: WriteHandle,
        block: Sequence[int],
        inner: Sequence[int],
        parts: Sequence[ChunkPart],
        itemsize: int,
        codec: Codec | None = None,
        *,
        digests: bool = False,
        hashing: str | None = None,
    ) -> None:
        self.handle = handle
        self.codec = codec
        # Each chunk's content digest (by linear index), when asked: the piece's digest.
        self.digests: dict[int, bytes] | None = {} if digests else None
        self.inner = tuple(inner)
        self.chunk_bytes = math.prod(inner) * itemsize
        nchunks = math.prod(inner_grid(block, inner))
        self.index = np.full((nchunks, 2), EMPTY, dtype="<u8")
        self.table = np.zeros(nchunks, dtype="<u4")
        # A signed save's hash table (see the module docstring), after the checksum table.
        self.hashing = hashing
        self._hasher = None if hashing is None else hashes.hasher(hashing)
        self.hashes = np.zeros((nchunks if hashing else 0, hashes.HASH_BYTES), dtype=np.uint8)
        self.head = self.table.nbytes + self.hashes.nbytes
        self._slot = {p.linear: k for k, p in enumerate(parts)}
        self._end = self.head + (0 if codec else len(parts) * (self.chunk_bytes + 4))
        self._lock = threading.Lock()
        self._finished = False

    def write(self, linear: int, raw: np.ndarray) -> int:
        """Write inner chunk ``linear`` (its raw bytes, flat uint8); return bytes stored."""
        if self.codec is None:
            return self.write_many([(linear, raw)])
        stored = self.codec.encode(raw)
        crc = crc32c(stored)
        with self._lock:
            offset, self._end = self._end, self._end + len(stored) + 4
        if self.digests is not None:
            self.digests[linear] = digests.chunk_digest(raw)
        tail = struct.pack("<I", crc)
        self._hash(linear, stored, tail)
        length = self.handle.write([stored, tail], offset)
        self.table[linear] = crc
        self.index[linear] = (offset, length)
        return length

    def write_many(self, chunks: Sequence[tuple[int, np.ndarray]]) -> int:
        """Write inner chunks (linear index, raw bytes) as :meth:`write` would, in one
        request when they are raw and their places follow each other; return bytes
        stored. The raw bytes must stay unchanged until this returns."""
        slots = [self._slot[linear] for linear, _ in chunks]
        if self.codec is not None or any(b != a + 1 for a, b in zip(slots, slots[1:])):
            return sum(self.write(linear, raw) for linear, raw in chunks)  # one at a time
        buffers: list[np.ndarray | bytes] = []
        for linear, raw in chunks:
            crc = crc32c(raw)  # first: the digest and the write then find it in the cache
            if self.digests is not None:
                self.digests[linear] = digests.chunk_digest(raw)
            tail = struct.pack("<I", crc)
            self._hash(linear, raw, tail)
            buffers += [raw, tail]
            self.table[linear] = crc
        offset = self.head + slots[0] * (self.chunk_bytes + 4)
        length = self.handle.write(buffers, offset)
        for k, (linear, _) in enumerate(chunks):
            self.index[linear] = (offset + k * (self.chunk_bytes + 4), self.chunk_bytes + 4)
        return length

    def _hash(self, linear: int, stored: Any, tail: bytes) -> None:
        """Record the hash of one inner chunk's stored bytes and crc32c (a signed save's)."""
        if self._hasher is not None:
            h = self._hasher()
            h.update(stored)
            h.update(tail)
            self.hashes[linear] = np.frombuffer(h.digest(), dtype=np.uint8)

    def finish(self, durable: bool = True) -> Stored:
        """Write the shard index and the checksum (and hash) tables and finish the file
        (durably); return its size, the table's crc and (when asked) the piece's digest
        and hash."""
        try:
            index_bytes = self.index.tobytes()
            tail = [index_bytes, struct.pack("<I", crc32c(index_bytes))]
            size = self._end + self.handle.write(tail, self._end)
            self.handle.write([self.table, self.hashes] if self.hashing else [self.table], 0)
            self.handle.finish(durable)
            self._finished = True
        finally:
            self.close()
        piece_hash = None
        if self.hashing is not None:
            piece_hash = hashes.digest(self.hashing, self.table.view(np.uint8), self.hashes, *tail)
        if self.digests is None:
            return Stored(size, crc32c(self.table), hash=piece_hash)
        chunks = tuple(self.digests[k] for k in sorted(self.digests))
        return Stored(
            size,
            crc32c(self.table),
            digests.piece_digest(chunks),
            chunks=chunks,
            hash=piece_hash,
        )

    def close(self) -> None:
        """Give up the file unless it was finished (after a failure elsewhere)."""
        if not self._finished:
            self.handle.abort()


def write_sharded(
    store: Store,
    key: str,
    data: np.ndarray,
    block: Sequence[int],
    inner: Sequence[int],
    *,
    codec: Codec | None = None,
    fsync: bool = True,
    hashing: str | None = None,
) -> Stored:
    """Write ``data`` (the piece's box, origin at the block's origin) as one shard file,
    each inner chunk compressed by ``codec`` if given, on the calling thread (a save
    writes with several: :mod:`distckpt.transfer.writer`).

    ``data.shape`` may be smaller than ``block`` at the edge of the array: inner chunks
    that lie wholly outside ``data`` are marked absent, partly outside ones are padded with
    zeros. Returns (file size, crc32c of the checksum table).
    """
    parts = chunk_parts(data.shape, block, inner, data.dtype.itemsize)
    size_hint = math.prod(block) * data.dtype.itemsize
    handle = store.create(key, size_hint)
    shard = ShardFile(handle, block, inner, parts, data.dtype.itemsize, codec, hashing=hashing)
    try:
        scratch = np.empty(shard.chunk_bytes, dtype=np.uint8)
        for chunk in parts:
            shard.write(chunk.linear, stored_chunk(data[chunk.slices], chunk, inner, scratch))
        return shard.finish(fsync)
    finally:
        shard.close()


def write_plain(
    store: Store,
    key: str,
    data: np.ndarray,
    *,
    fsync: bool = True,
    digest: bool = False,
    hashing: str | None = None,
) -> Stored:
    """Write ``data`` as one plain chunk (bytes, then crc32c). Returns its size, crc and
    (with ``digest``) content digest, and (with ``hashing``) the file's hash."""
    raw = as_bytes(np.ascontiguousarray(data))
    crc = crc32c(raw)
    tail = struct.pack("<I", crc)
    size = write_whole(store, key, [raw, tail], durable=fsync)
    piece_hash = None if hashing is None else hashes.digest(hashing, raw, tail)
    return Stored(size, crc, digests.plain_digest(raw) if digest else None, hash=piece_hash)

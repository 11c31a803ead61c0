"""Writing the bytes of one stored piece, in zarr v3's own formats (read back by
:mod:`distckpt.storage.piece_reader`).

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

A sharded piece may be **compressed** (:mod:`distckpt.storage.codecs`): each inner chunk
is then stored as its compressed bytes followed by the crc32c *of those compressed
bytes* (codecs ``bytes`` + ``zstd``/``blosc`` + ``crc32c``), the shard index records each
chunk's own length, and the checksum table holds the same crc32c values. Inner chunks are
compressed independently (several at a time, on a few threads) and a reader decompresses
only the chunks it needs, each into a buffer of one inner chunk.

The checkpoint index records one crc32c per piece: of the checksum table for a shard, of
the data for a plain chunk. Both depend on the data, so a file swapped for another of the
same shape, truncated, or damaged is caught before its bytes are used, and a reader that
needs one inner chunk still verifies it against the index without reading the others.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c as _crc
import numpy as np

from distckpt.slices import Box
from distckpt.storage.codecs import Codec

EMPTY = 2**64 - 1
_IOV_MAX = 1024
#: Bytes read per system call when reading an inner chunk: small enough that the checksum
#: of each step runs on data still in the CPU cache.
STEP = 1 << 20
#: Threads that compress inner chunks of one shard; each holds at most two chunks.
_COMPRESS_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def _view(data: np.ndarray | bytes | bytearray | memoryview) -> memoryview:
    return data.data if isinstance(data, np.ndarray) else memoryview(data)


def crc32c(data: np.ndarray | bytes | bytearray | memoryview) -> int:
    return int(_crc.crc32c(_view(data)))


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, ml_dtypes included)."""
    return array.reshape(-1).view(np.uint8)


def inner_grid(block: Sequence[int], inner: Sequence[int]) -> tuple[int, ...]:
    return tuple(b // i for b, i in zip(block, inner, strict=True))


def _write_all(fd: int, buffers: list[np.ndarray | bytes]) -> int:
    total = 0
    for start in range(0, len(buffers), _IOV_MAX):
        batch: list[memoryview] = [_view(b) for b in buffers[start : start + _IOV_MAX]]
        want = sum(b.nbytes for b in batch)
        done = os.writev(fd, batch)
        total += done
        if done < want:  # rare (signals, some network file systems): finish byte by byte
            flat = memoryview(b"".join(bytes(b) for b in batch))[done:]
            while flat:
                n = os.write(fd, flat)
                flat = flat[n:]
                total += n
    return total


def _open_new(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _present_chunks(
    data: np.ndarray, block: Sequence[int], inner: Sequence[int]
) -> Iterator[tuple[int, np.ndarray]]:
    """(C-order position, flat uint8 bytes) of every inner chunk that meets ``data``; edge
    chunks padded with zeros."""
    grid = inner_grid(block, inner)
    data_box = Box.full(data.shape)
    for linear, coord in enumerate(itertools.product(*(range(g) for g in grid))):
        chunk_box = Box(tuple(c * i for c, i in zip(coord, inner, strict=True)), tuple(inner))
        part = chunk_box.intersect(data_box)
        if part is None:
            continue
        if part == chunk_box:
            chunk = np.ascontiguousarray(data[chunk_box.slices()])
        else:
            chunk = np.zeros(tuple(inner), dtype=data.dtype)
            chunk[part.relative_to(chunk_box).slices()] = data[part.slices()]
        yield linear, as_bytes(chunk)


def _compressed(
    chunks: Iterator[tuple[int, np.ndarray]], codec: Codec
) -> Iterator[tuple[int, bytes, int]]:
    """(position, compressed bytes, their crc32c) of each chunk, in order. Compresses up to
    ``2 * _COMPRESS_THREADS`` chunks at a time (the codecs release the GIL)."""

    def encode(raw: np.ndarray) -> tuple[bytes, int]:
        stored = codec.encode(raw)
        return stored, crc32c(stored)

    with ThreadPoolExecutor(_COMPRESS_THREADS, thread_name_prefix="distckpt-compress") as pool:
        pending: deque[tuple[int, Future[tuple[bytes, int]]]] = deque()
        for linear, raw in chunks:
            pending.append((linear, pool.submit(encode, raw)))
            if len(pending) >= 2 * _COMPRESS_THREADS:
                first, future = pending.popleft()
                yield first, *future.result()
        while pending:
            first, future = pending.popleft()
            yield first, *future.result()


def write_sharded(
    path: str,
    data: np.ndarray,
    block: Sequence[int],
    inner: Sequence[int],
    *,
    codec: Codec | None = None,
    fsync: bool = True,
) -> tuple[int, int]:
    """Write ``data`` (the piece's box, origin at the block's origin) as one shard file,
    each inner chunk compressed by ``codec`` if given.

    ``data.shape`` may be smaller than ``block`` at the edge of the array: inner chunks
    that lie wholly outside ``data`` are marked absent, partly outside ones are padded with
    zeros. Returns (file size, crc32c of the checksum table).
    """
    grid = inner_grid(block, inner)
    index = np.full((math.prod(grid), 2), EMPTY, dtype="<u8")
    table = np.zeros(math.prod(grid), dtype="<u4")
    fd = _open_new(path)
    try:
        offset = os.lseek(fd, table.nbytes, os.SEEK_SET)  # the table is written last
        chunks = _present_chunks(data, block, inner)
        if codec is None:
            for linear, raw in chunks:
                table[linear] = _stream_out(fd, raw)
                _write_all(fd, [struct.pack("<I", table[linear])])
                index[linear] = (offset, raw.nbytes + 4)
                offset += raw.nbytes + 4
        else:
            for linear, stored, crc in _compressed(chunks, codec):
                table[linear] = crc
                _write_all(fd, [stored, struct.pack("<I", crc)])
                index[linear] = (offset, len(stored) + 4)
                offset += len(stored) + 4
        index_bytes = index.tobytes()
        size = offset + _write_all(fd, [index_bytes, struct.pack("<I", crc32c(index_bytes))])
        if os.pwrite(fd, table.data, 0) != table.nbytes:
            raise OSError(f"short write of the checksum table of {path}")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc32c(table)


def _stream_out(fd: int, raw: np.ndarray) -> int:
    """Write ``raw`` in steps of :data:`STEP` bytes, checksumming each step just before
    writing it (while it is in the CPU cache); return the crc32c of all of it."""
    crc = 0
    for start in range(0, raw.nbytes, STEP):
        step = raw[start : start + STEP]
        crc = _crc.crc32c(step.data, crc)
        _write_all(fd, [step])
    return crc


def write_plain(path: str, data: np.ndarray, *, fsync: bool = True) -> tuple[int, int]:
    """Write ``data`` as one plain chunk (bytes, then crc32c). Returns (size, crc)."""
    raw = as_bytes(np.ascontiguousarray(data))
    crc = crc32c(raw)
    fd = _open_new(path)
    try:
        size = _write_all(fd, [raw, struct.pack("<I", crc)])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc

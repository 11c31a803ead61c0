"""Reading and writing the bytes of one stored piece, in zarr v3's own formats.

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
  ``crc32c``), for small arrays.

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
from collections.abc import Callable, Sequence

import crc32c as _crc
import numpy as np

from distckpt.errors import CorruptCheckpointError
from distckpt.slices import Box

EMPTY = 2**64 - 1
_IOV_MAX = 1024
#: Bytes read per system call when reading an inner chunk: small enough that the checksum
#: of each step runs on data still in the CPU cache.
_STEP = 1 << 20


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


def write_sharded(
    path: str, data: np.ndarray, block: Sequence[int], inner: Sequence[int], *, fsync: bool = True
) -> tuple[int, int]:
    """Write ``data`` (the piece's box, origin at the block's origin) as one shard file.

    ``data.shape`` may be smaller than ``block`` at the edge of the array: inner chunks
    that lie wholly outside ``data`` are marked absent, partly outside ones are padded with
    zeros. Returns (file size, crc32c of the checksum table).
    """
    grid = inner_grid(block, inner)
    data_box = Box.full(data.shape)
    index = np.full((math.prod(grid), 2), EMPTY, dtype="<u8")
    table = np.zeros(math.prod(grid), dtype="<u4")
    fd = _open_new(path)
    try:
        offset = os.lseek(fd, table.nbytes, os.SEEK_SET)  # the table is written last
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
            raw = as_bytes(chunk)
            table[linear] = _stream_out(fd, raw)
            _write_all(fd, [struct.pack("<I", table[linear])])
            index[linear] = (offset, raw.nbytes + 4)
            offset += raw.nbytes + 4
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
    """Write ``raw`` in steps of :data:`_STEP` bytes, checksumming each step just before
    writing it (while it is in the CPU cache); return the crc32c of all of it."""
    crc = 0
    for start in range(0, raw.nbytes, _STEP):
        step = raw[start : start + _STEP]
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


def _row_run(part: Box, chunk: Box) -> tuple[int, int] | None:
    """(first, end) rows of ``chunk`` that ``part`` covers, when ``part`` is whole rows of it
    (it spans the chunk in every dimension but the first); else None."""
    if part.ndim == 0:
        return (0, 1)
    if part.lengths[1:] != chunk.lengths[1:]:
        return None
    start = part.offsets[0] - chunk.offsets[0]
    return start, start + part.lengths[0]


class PieceReader:
    """Reads regions of stored pieces into destination arrays, verifying every checksum.

    ``variable`` names the variable in error messages.
    """

    def __init__(self, variable: str, path: str, dtype: np.dtype, expected_crc: int) -> None:
        self.variable = variable
        self.path = path
        self.dtype = dtype
        self.expected_crc = expected_crc

    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"variable {self.variable!r}: {what} ({self.path})")

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._corrupt("a file the index names is missing") from None

    def read_plain(self, block: Sequence[int], src: Box, out: np.ndarray) -> int:
        """Copy ``src`` (in block coordinates) of a plain chunk into ``out``. Returns bytes read."""
        nbytes = math.prod(block) * self.dtype.itemsize
        fd = self._open()
        try:
            size = os.fstat(fd).st_size
            buf = np.empty(nbytes + 4, dtype=np.uint8)
            got = os.preadv(fd, [buf.data], 0)
        finally:
            os.close(fd)
        if got != nbytes + 4 or size != nbytes + 4:
            raise self._corrupt(f"chunk is {size} bytes, expected {nbytes + 4}")
        stored = int.from_bytes(buf[nbytes:].tobytes(), "little")
        if stored != self.expected_crc or crc32c(buf[:nbytes]) != stored:
            raise self._corrupt("chunk fails its crc32c checksum")
        chunk = buf[:nbytes].view(self.dtype).reshape(tuple(block))
        out[...] = chunk[src.slices()]
        return got

    def _read_verified(
        self, fd: int, offset: int, segments: list[np.ndarray], expected: int, coord: object
    ) -> None:
        """Read one inner chunk (its bytes scattered over ``segments``, then its crc32c) and
        verify it. Reads in steps of at most :data:`_STEP` bytes and checksums each step
        while it is still in the CPU cache."""
        crc = 0
        for segment in segments:
            for start in range(0, segment.nbytes, _STEP):
                piece = segment[start : start + _STEP]
                if os.preadv(fd, [piece.data], offset) != piece.nbytes:
                    raise self._corrupt(f"inner chunk {coord} is truncated")
                crc = _crc.crc32c(piece.data, crc)
                offset += piece.nbytes
        stored = int.from_bytes(os.pread(fd, 4, offset), "little")
        if stored != expected or crc != stored:
            raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")

    def _read_header(self, fd: int, nchunks: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(file size, checksum table, shard index as (nchunks, 2) offsets and lengths) of
        a shard, each verified: the table against the checkpoint index, the shard index
        against its own crc32c."""
        size = os.fstat(fd).st_size
        index_len = nchunks * 16 + 4
        if size < index_len:
            raise self._corrupt(f"shard is truncated ({size} bytes)")
        raw_table = os.pread(fd, nchunks * 4, 0)
        if len(raw_table) != nchunks * 4 or crc32c(raw_table) != self.expected_crc:
            raise self._corrupt("shard checksum table does not match the checkpoint index")
        table = np.frombuffer(raw_table, dtype="<u4")
        raw_index = os.pread(fd, index_len, size - index_len)
        if crc32c(raw_index[:-4]) != int.from_bytes(raw_index[-4:], "little"):
            raise self._corrupt("shard index fails its crc32c checksum")
        index = np.frombuffer(raw_index[:-4], dtype="<u8").reshape(nchunks, 2)
        return size, table, index

    def verify_sharded(
        self,
        block: Sequence[int],
        inner: Sequence[int],
        lengths: Sequence[int],
        on_bytes: Callable[[int], None] | None = None,
    ) -> int:
        """Read a whole shard and check all of it, keeping one inner chunk in memory.

        Checks the checksum table against the checkpoint index, the shard index against
        its crc32c, that every inner chunk holding data (those meeting the first
        ``lengths`` of the block) is present with the right size and passes its crc32c,
        and that the file ends where its index says. ``on_bytes(n)`` is called after each
        inner chunk. Returns the bytes read.
        """
        grid = inner_grid(block, inner)
        nchunks = math.prod(grid)
        chunk_bytes = math.prod(inner) * self.dtype.itemsize
        index_len = nchunks * 16 + 4
        data_box = Box.full(lengths)
        fd = self._open()
        try:
            size, table, index = self._read_header(fd, nchunks)
            total = index_len + nchunks * 4
            end = nchunks * 4
            scratch = np.empty(chunk_bytes, dtype=np.uint8)
            for linear, coord in enumerate(itertools.product(*(range(g) for g in grid))):
                chunk_box = Box(
                    tuple(c * i for c, i in zip(coord, inner, strict=True)), tuple(inner)
                )
                offset, length = (int(v) for v in index[linear])
                if offset == EMPTY:
                    if chunk_box.intersect(data_box) is not None:
                        raise self._corrupt(f"inner chunk {coord} is missing")
                    continue
                if length != chunk_bytes + 4 or offset + length > size - index_len:
                    raise self._corrupt(f"inner chunk {coord} has the wrong size")
                self._read_verified(fd, offset, [scratch], table[linear], coord)
                end = max(end, offset + length)
                total += length
                if on_bytes is not None:
                    on_bytes(length)
            if end + index_len != size:
                raise self._corrupt(f"shard is {size} bytes, its index ends at {end + index_len}")
            return total
        finally:
            os.close(fd)

    def read_sharded(
        self, block: Sequence[int], inner: Sequence[int], src: Box, out: np.ndarray
    ) -> int:
        """Copy ``src`` (in block coordinates) of a shard into ``out``, reading only the inner
        chunks that intersect it. Returns bytes read."""
        grid = inner_grid(block, inner)
        nchunks = math.prod(grid)
        chunk_bytes = math.prod(inner) * self.dtype.itemsize
        fd = self._open()
        try:
            size, table, index = self._read_header(fd, nchunks)
            total = nchunks * 16 + 4 + nchunks * 4
            first = tuple(o // i for o, i in zip(src.offsets, inner, strict=True))
            last = tuple(
                (o + n - 1) // i for o, n, i in zip(src.offsets, src.lengths, inner, strict=True)
            )
            scratch = np.empty(0, dtype=np.uint8)
            for coord in itertools.product(*(range(a, b + 1) for a, b in zip(first, last))):
                chunk_box = Box(
                    tuple(c * i for c, i in zip(coord, inner, strict=True)), tuple(inner)
                )
                part = chunk_box.intersect(src)
                if part is None:
                    continue
                linear = int(np.ravel_multi_index(coord, grid)) if grid else 0
                offset, length = (int(v) for v in index[linear])
                if offset == EMPTY or length != chunk_bytes + 4 or offset + length > size:
                    raise self._corrupt(f"inner chunk {coord} is missing or has the wrong size")
                dst = out[part.relative_to(src).slices()]
                rows = _row_run(part, chunk_box)
                if rows is not None and dst.flags.c_contiguous:
                    # The needed rows go straight into the destination; the chunk's other
                    # rows (read only to verify its checksum) into scratch: no copy.
                    row_bytes = chunk_bytes // inner[0] if inner else chunk_bytes
                    before, after = rows[0] * row_bytes, chunk_bytes - rows[1] * row_bytes
                    if scratch.nbytes < before + after:
                        scratch = np.empty(before + after, dtype=np.uint8)
                    segments = [scratch[:before], as_bytes(dst), scratch[before : before + after]]
                    self._read_verified(fd, offset, segments, table[linear], coord)
                else:
                    if scratch.nbytes < chunk_bytes:
                        scratch = np.empty(chunk_bytes, dtype=np.uint8)
                    whole = scratch[:chunk_bytes]
                    self._read_verified(fd, offset, [whole], table[linear], coord)
                    chunk = whole.view(self.dtype).reshape(tuple(inner))
                    dst[...] = chunk[part.relative_to(chunk_box).slices()]
                total += length
            return total
        finally:
            os.close(fd)

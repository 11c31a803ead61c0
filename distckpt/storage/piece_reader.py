"""Reading stored pieces back (formats in :mod:`distckpt.storage.shard_io`), verifying
every checksum on the way.

A restore reads only the inner chunks of a shard that its target box meets. A raw inner
chunk is read in steps straight into the target where the target takes whole rows of it,
the rest into scratch; a compressed one is read whole, checked, and decompressed into the
target (when the target takes all of it) or into one inner chunk of scratch.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c as _crc
import numpy as np

from distckpt.errors import CorruptCheckpointError
from distckpt.slices import Box
from distckpt.storage.codecs import Codec
from distckpt.storage.shard_io import EMPTY, STEP, as_bytes, crc32c, inner_grid


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

    ``variable`` names the variable in error messages; ``codec`` is the piece's codec, as
    the index records it (None: stored raw).
    """

    def __init__(
        self,
        variable: str,
        path: str,
        dtype: np.dtype,
        expected_crc: int,
        codec: Codec | None = None,
    ) -> None:
        self.variable = variable
        self.path = path
        self.dtype = dtype
        self.expected_crc = expected_crc
        self.codec = codec

    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"variable {self.variable!r}: {what} ({self.path})")

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._corrupt("a file the index names is missing") from None

    def read_plain(self, block: Sequence[int], src: Box, out: np.ndarray) -> int:
        """Copy ``src`` (in block coordinates) of a plain chunk into ``out``. Returns bytes read."""
        if self.codec is not None:
            raise self._corrupt("the index records a codec for a plain chunk")
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
        verify it. Reads in steps of at most :data:`STEP` bytes and checksums each step
        while it is still in the CPU cache."""
        crc = 0
        for segment in segments:
            for start in range(0, segment.nbytes, STEP):
                piece = segment[start : start + STEP]
                if os.preadv(fd, [piece.data], offset) != piece.nbytes:
                    raise self._corrupt(f"inner chunk {coord} is truncated")
                crc = _crc.crc32c(piece.data, crc)
                offset += piece.nbytes
        stored = int.from_bytes(os.pread(fd, 4, offset), "little")
        if stored != expected or crc != stored:
            raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")

    def _read_compressed(
        self, fd: int, offset: int, length: int, expected: int, coord: object, out: np.ndarray
    ) -> None:
        """Read one compressed inner chunk (``length`` bytes with its crc32c), verify the
        crc32c of its stored bytes, and decompress it into ``out`` (flat uint8)."""
        assert self.codec is not None
        stored = scratch(length, 1)
        if os.preadv(fd, [stored.data], offset) != length:
            raise self._corrupt(f"inner chunk {coord} is truncated")
        crc = int.from_bytes(stored[-4:].tobytes(), "little")
        if crc != expected or crc32c(stored[:-4]) != crc:
            raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")
        try:
            self.codec.decode(stored[:-4], out)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise self._corrupt(
                f"inner chunk {coord} does not decompress with {self.codec.name} ({exc})"
            ) from None

    def _chunk_fits(self, offset: int, length: int, chunk_bytes: int, end: int) -> bool:
        """Whether an index entry can hold one inner chunk: present, inside the data area
        (which ends at ``end``), of its raw size plus 4 or, compressed, of any size."""
        if offset == EMPTY or offset + length > end:
            return False
        return length > 4 if self.codec is not None else length == chunk_bytes + 4

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
        and that the file ends where its index says. ``on_bytes(n)`` is called after the
        checksum table and index, and after each inner chunk. Returns the bytes read.
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
            if on_bytes is not None:
                on_bytes(total)
            end = nchunks * 4
            buf = scratch(chunk_bytes, 0)
            for linear, coord in enumerate(itertools.product(*(range(g) for g in grid))):
                chunk_box = Box(
                    tuple(c * i for c, i in zip(coord, inner, strict=True)), tuple(inner)
                )
                offset, length = (int(v) for v in index[linear])
                if offset == EMPTY:
                    if chunk_box.intersect(data_box) is not None:
                        raise self._corrupt(f"inner chunk {coord} is missing")
                    continue
                if not self._chunk_fits(offset, length, chunk_bytes, size - index_len):
                    raise self._corrupt(f"inner chunk {coord} has the wrong size")
                if self.codec is None:
                    self._read_verified(fd, offset, [buf], table[linear], coord)
                else:
                    self._read_compressed(fd, offset, length, table[linear], coord, buf)
                end = max(end, offset + length)
                total += length
                if on_bytes is not None:
                    on_bytes(length)
            if end + index_len != size:
                raise self._corrupt(f"shard is {size} bytes, its index ends at {end + index_len}")
            return total
        finally:
            os.close(fd)

    def chunk_reads(
        self, block: Sequence[int], inner: Sequence[int], src: Box
    ) -> list[tuple[tuple[int, ...], int, Box, Box]]:
        """The inner chunks that ``src`` (block coordinates) meets: (coord, position in
        the shard index, chunk box, the part of ``src`` in it), in C order."""
        grid = inner_grid(block, inner)
        first = tuple(o // i for o, i in zip(src.offsets, inner, strict=True))
        last = tuple(
            (o + n - 1) // i for o, n, i in zip(src.offsets, src.lengths, inner, strict=True)
        )
        found = []
        for coord in itertools.product(*(range(a, b + 1) for a, b in zip(first, last))):
            chunk_box = Box(tuple(c * i for c, i in zip(coord, inner, strict=True)), tuple(inner))
            part = chunk_box.intersect(src) if chunk_box.ndim else chunk_box
            if part is None:
                continue
            linear = int(np.ravel_multi_index(coord, grid)) if grid else 0
            found.append((coord, linear, chunk_box, part))
        return found

    def header(self, fd: int, block: Sequence[int], inner: Sequence[int]) -> ShardHeader:
        """The verified checksum table and shard index of an open shard."""
        nchunks = math.prod(inner_grid(block, inner))
        size, table, index = self._read_header(fd, nchunks)
        return ShardHeader(size, table, index, nchunks * 16 + 4 + nchunks * 4)

    def read_chunk(
        self,
        fd: int,
        header: ShardHeader,
        inner: Sequence[int],
        chunk: tuple[tuple[int, ...], int, Box, Box],
        src: Box,
        out: np.ndarray,
    ) -> int:
        """Copy the part of ``src`` in one inner chunk (from :meth:`chunk_reads`) into
        ``out`` (shaped like ``src``), verifying the chunk. Returns bytes read."""
        coord, linear, chunk_box, part = chunk
        chunk_bytes = math.prod(inner) * self.dtype.itemsize
        offset, length = (int(v) for v in header.index[linear])
        if not self._chunk_fits(offset, length, chunk_bytes, header.size):
            raise self._corrupt(f"inner chunk {coord} is missing or has the wrong size")
        dst = out[part.relative_to(src).slices()]
        rows = _row_run(part, chunk_box)
        expected = header.table[linear]
        if self.codec is not None:
            # A compressed chunk is decompressed whole: straight into the destination
            # when it needs all of it, else into scratch.
            direct = part == chunk_box and dst.flags.c_contiguous
            whole = as_bytes(dst) if direct else scratch(chunk_bytes, 0)
            self._read_compressed(fd, offset, length, expected, coord, whole)
            if not direct:
                view = whole.view(self.dtype).reshape(tuple(inner))
                dst[...] = view[part.relative_to(chunk_box).slices()]
        elif rows is not None and dst.flags.c_contiguous:
            # The needed rows go straight into the destination; the chunk's other rows
            # (read only to verify its checksum) into scratch: no copy.
            row_bytes = chunk_bytes // inner[0] if inner else chunk_bytes
            before, after = rows[0] * row_bytes, chunk_bytes - rows[1] * row_bytes
            spare = scratch(before + after, 0)
            segments = [spare[:before], as_bytes(dst), spare[before : before + after]]
            self._read_verified(fd, offset, segments, expected, coord)
        else:
            whole = scratch(chunk_bytes, 0)
            self._read_verified(fd, offset, [whole], expected, coord)
            view = whole.view(self.dtype).reshape(tuple(inner))
            dst[...] = view[part.relative_to(chunk_box).slices()]
        return length

    def read_sharded(
        self, block: Sequence[int], inner: Sequence[int], src: Box, out: np.ndarray
    ) -> int:
        """Copy ``src`` (in block coordinates) of a shard into ``out``, reading only the inner
        chunks that intersect it, on the calling thread. Returns bytes read."""
        fd = self._open()
        try:
            header = self.header(fd, block, inner)
            total = header.nbytes
            for chunk in self.chunk_reads(block, inner, src):
                total += self.read_chunk(fd, header, inner, chunk, src, out)
            return total
        finally:
            os.close(fd)


@dataclass(frozen=True)
class ShardHeader:
    """A shard's size, checksum table and index (offset, length per inner chunk), verified;
    ``nbytes``: the bytes read for them."""

    size: int
    table: np.ndarray
    index: np.ndarray
    nbytes: int


_local = threading.local()


def scratch(nbytes: int, slot: int) -> np.ndarray:
    """A flat uint8 buffer of ``nbytes`` owned by this thread (``slot`` 0 or 1: two may be
    in use at once). Reused by the next call; buffers over 64 MiB are not kept."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
    if buffers[slot].nbytes >= nbytes:
        return buffers[slot][:nbytes]
    fresh = np.empty(nbytes, dtype=np.uint8)
    if nbytes <= 64 << 20:
        buffers[slot] = fresh
    return fresh

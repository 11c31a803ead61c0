"""Reading stored pieces back (formats in :mod:`distckpt.format.shard_io`), verifying
every checksum on the way.

A restore reads only the inner chunks of a shard that its target box meets. A raw inner
chunk is read in steps straight into the target where the target takes whole rows of it,
the rest into scratch; a compressed one is read whole, checked, and decompressed into the
target (when the target takes all of it) or into one inner chunk of scratch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import crc32c as _crc
import numpy as np

from distckpt.errors import CorruptCheckpointError, UnsafePathError, UntrustedCheckpointError
from distckpt.format.codecs import Codec
from distckpt.format.read_parts import ChunkRead, ShardHeader, scratch
from distckpt.format.shard_io import EMPTY, STEP, as_bytes, crc32c, inner_grid
from distckpt.format.wellformed import MAX_RATIO
from distckpt.signing import hashes
from distckpt.signing.hashes import HASH_BYTES
from distckpt.slices import Box
from distckpt.storage.backend import ReadHandle, Store


class PieceReader:
    """Reads regions of stored pieces into destination arrays, verifying every checksum.

    ``variable`` names the variable in error messages; ``codec`` is the piece's codec, as
    the index records it (None: stored raw). ``auth`` (a reader that requires a signed
    checkpoint): the hash algorithm and the piece's hash, from the signed index; every
    byte read is then also checked against it (a shard's tables and index against the
    piece's hash, each inner chunk against its row of the hash table; see
    :mod:`distckpt.format.shard_io`), and a mismatch is an
    :class:`~distckpt.errors.UntrustedCheckpointError`.
    """

    def __init__(
        self,
        variable: str,
        store: Store,
        key: str,
        dtype: np.dtype,
        expected_crc: int,
        codec: Codec | None = None,
        size: int | None = None,
        auth: tuple[str, bytes] | None = None,
    ) -> None:
        self.variable = variable
        self.store = store
        self.key = key
        self.path = store.where(key)
        self.dtype = dtype
        self.expected_crc = expected_crc
        self.codec = codec
        self.size = size
        self.auth = auth
        self._hasher = None if auth is None else hashes.hasher(auth[0])

    def _corrupt(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"variable {self.variable!r}: {what} ({self.path})")

    def _untrusted(self, what: str) -> UntrustedCheckpointError:
        return UntrustedCheckpointError(
            f"variable {self.variable!r}: {what} does not match its signed hash (edited since "
            f"it was signed) ({self.path})"
        )

    def _check_hash(self, want: bytes | None, what: str, *parts: Any) -> None:
        """Check the hash of ``parts`` against ``want`` (nothing to check: None)."""
        if want is None or self._hasher is None:
            return
        h = self._hasher()
        for part in parts:
            h.update(part)
        if h.digest() != want:
            raise self._untrusted(what)

    def open(self) -> ReadHandle:
        """The piece's file, open for reading (``size``: the index's, saving a request).
        A file found missing, now or at a later read (an object store opens lazily), is
        the checkpoint's damage: :class:`CorruptCheckpointError`."""
        try:
            return _Named(self.store.open(self.key, self.size), self)
        except FileNotFoundError:
            raise self._corrupt("a file the index names is missing") from None
        except UnsafePathError as exc:  # a link, a FIFO: never opened
            raise UnsafePathError(f"variable {self.variable!r}: {exc}") from None

    def read_plain(self, block: Sequence[int], src: Box, out: np.ndarray) -> int:
        """Copy ``src`` (in block coordinates) of a plain chunk into ``out``. Returns bytes read."""
        if self.codec is not None:
            raise self._corrupt("the index records a codec for a plain chunk")
        nbytes = math.prod(block) * self.dtype.itemsize
        handle = self.open()
        try:
            size = handle.size  # what is stored, checked before allocating for it
            if size != nbytes + 4:
                raise self._corrupt(f"chunk is {size} bytes, expected {nbytes + 4}")
            buf = np.empty(nbytes + 4, dtype=np.uint8)
            got = handle.readinto([buf], 0)
        finally:
            handle.close()
        if got != nbytes + 4:
            raise self._corrupt(f"chunk is {got} bytes, expected {nbytes + 4}")
        stored = int.from_bytes(buf[nbytes:].tobytes(), "little")
        if stored != self.expected_crc or crc32c(buf[:nbytes]) != stored:
            raise self._corrupt("chunk fails its crc32c checksum")
        self._check_hash(None if self.auth is None else self.auth[1], "the chunk", buf)
        chunk = buf[:nbytes].view(self.dtype).reshape(tuple(block))
        out[...] = chunk[src.slices()]
        return got

    def _read_verified(
        self,
        fd: ReadHandle,
        offset: int,
        segments: list[np.ndarray],
        expected: int,
        coord: object,
        want: bytes | None = None,
    ) -> None:
        """Read one inner chunk (its bytes scattered over ``segments``, then its crc32c) and
        verify it (and its hash against ``want``, when given). Reads in steps of at most
        :data:`STEP` bytes and checksums each step while it is still in the CPU cache;
        the crc32c comes with the last step."""
        steps = [
            segment[start : start + STEP]
            for segment in segments
            for start in range(0, segment.nbytes, STEP)
        ]
        tail = bytearray(4)
        crc = 0
        h = None if want is None or self._hasher is None else self._hasher()
        for k, step in enumerate(steps):
            last = k == len(steps) - 1
            buffers: list[Any] = [step, tail] if last else [step]
            need = step.nbytes + (4 if last else 0)
            if fd.readinto(buffers, offset) != need:
                raise self._corrupt(f"inner chunk {coord} is truncated")
            crc = _crc.crc32c(step.data, crc)
            if h is not None:
                h.update(step.data)
            offset += step.nbytes
        if not steps and fd.readinto([tail], offset) != 4:
            raise self._corrupt(f"inner chunk {coord} is truncated")
        stored = int.from_bytes(tail, "little")
        if stored != expected or crc != stored:
            raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")
        if h is not None:
            h.update(tail)
            if h.digest() != want:
                raise self._untrusted(f"inner chunk {coord}")

    def _read_compressed(
        self,
        fd: ReadHandle,
        offset: int,
        length: int,
        expected: int,
        coord: object,
        out: np.ndarray,
        want: bytes | None = None,
    ) -> None:
        """Read one compressed inner chunk (``length`` bytes with its crc32c), verify the
        crc32c of its stored bytes (and their hash against ``want``, when given), and
        decompress it into ``out`` (flat uint8)."""
        assert self.codec is not None
        stored = scratch(length, 1)
        if fd.readinto([stored], offset) != length:
            raise self._corrupt(f"inner chunk {coord} is truncated")
        crc = int.from_bytes(stored[-4:].tobytes(), "little")
        if crc != expected or crc32c(stored[:-4]) != crc:
            raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")
        self._check_hash(want, f"inner chunk {coord}", stored)
        try:
            self.codec.decode(stored[:-4], out)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise self._corrupt(
                f"inner chunk {coord} does not decompress with {self.codec.name} ({exc})"
            ) from None

    def _chunk_fits(self, offset: int, length: int, chunk_bytes: int, end: int) -> bool:
        """Whether an index entry can hold one inner chunk: present, inside the data area
        (which ends at ``end``), of its raw size plus 4 or, compressed, of a size it can
        decompress from (:data:`~distckpt.format.wellformed.MAX_RATIO`): a reader then
        allocates nothing that the stored bytes do not back."""
        if offset == EMPTY or offset + length > end:
            return False
        if self.codec is not None:
            return length > 4 and chunk_bytes <= length * MAX_RATIO
        return length == chunk_bytes + 4

    def verify_sharded(
        self,
        block: Sequence[int],
        inner: Sequence[int],
        lengths: Sequence[int],
        on_bytes: Callable[[int], None] | None = None,
        on_chunk: Callable[[int, np.ndarray], None] | None = None,
    ) -> int:
        """Read a whole shard and check all of it, keeping one inner chunk in memory;
        ``on_chunk(linear, raw)`` sees each chunk's raw bytes once checked (decompressed).

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
        fd = self.open()
        try:
            header = self.header(fd, block, inner)
            size, table, index = header.size, header.table, header.index
            total = header.nbytes
            if on_bytes is not None:
                on_bytes(total)
            end = header.head
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
                buf = scratch(chunk_bytes, 0)  # bounded by the chunk as stored (_chunk_fits)
                want = header.hash_of(linear)
                if self.codec is None:
                    self._read_verified(fd, offset, [buf], table[linear], coord, want)
                else:
                    self._read_compressed(fd, offset, length, table[linear], coord, buf, want)
                if on_chunk is not None:
                    on_chunk(linear, buf)
                end = max(end, offset + length)
                total += length
                if on_bytes is not None:
                    on_bytes(length)
            if end + index_len != size:
                raise self._corrupt(f"shard is {size} bytes, its index ends at {end + index_len}")
            return total
        finally:
            fd.close()

    def chunk_reads(self, block: Sequence[int], inner: Sequence[int], src: Box) -> list[ChunkRead]:
        """The inner chunks that ``src`` (block coordinates) meets, in C order."""
        grid = inner_grid(block, inner)
        strides = [math.prod(grid[d + 1 :]) for d in range(len(grid))]
        per_dim = []
        for d, (lo, n, size) in enumerate(zip(src.offsets, src.lengths, inner, strict=True)):
            hi = lo + n
            per_dim.append(
                [
                    (c * strides[d], c * size, max(lo, c * size), min(hi, (c + 1) * size))
                    for c in range(lo // size, (hi - 1) // size + 1)
                ]
            )
        return [
            ChunkRead(
                sum(e[0] for e in combo),
                tuple(e[1] for e in combo),
                tuple(e[2] for e in combo),
                tuple(e[3] - e[2] for e in combo),
            )
            for combo in itertools.product(*per_dim)
        ]

    def header(self, fd: ReadHandle, block: Sequence[int], inner: Sequence[int]) -> ShardHeader:
        """The file size, checksum table and shard index ((nchunks, 2) offsets and
        lengths) of an open shard, each verified: the table against the checkpoint index,
        the shard index against its own crc32c."""
        nchunks = math.prod(inner_grid(block, inner))
        size = fd.size
        index_len = nchunks * 16 + 4
        head = nchunks * (4 + (HASH_BYTES if self.auth is not None else 0))
        if size < index_len + head:
            raise self._corrupt(f"shard is truncated ({size} bytes)")
        raw_head = fd.read(0, head)
        raw_table = raw_head[: nchunks * 4]
        if len(raw_head) != head or crc32c(raw_table) != self.expected_crc:
            raise self._corrupt("shard checksum table does not match the checkpoint index")
        table = np.frombuffer(raw_table, dtype="<u4")
        raw_index = fd.read(size - index_len, index_len)
        if len(raw_index) != index_len or crc32c(raw_index[:-4]) != int.from_bytes(
            raw_index[-4:], "little"
        ):
            raise self._corrupt("shard index fails its crc32c checksum")
        index = np.frombuffer(raw_index[:-4], dtype="<u8").reshape(nchunks, 2)
        chunk_hashes = None
        if self.auth is not None:
            self._check_hash(self.auth[1], "the shard's tables and index", raw_head, raw_index)
            chunk_hashes = np.frombuffer(raw_head[nchunks * 4 :], np.uint8).reshape(
                nchunks, HASH_BYTES
            )
        return ShardHeader(size, table, index, index_len + head, chunk_hashes, head)

    def read_chunk(
        self,
        fd: ReadHandle,
        header: ShardHeader,
        inner: Sequence[int],
        chunk: ChunkRead,
        src: Box,
        out: np.ndarray,
    ) -> int:
        """Copy the part of ``src`` in one inner chunk (from :meth:`chunk_reads`) into
        ``out`` (shaped like ``src``), verifying the chunk. Returns bytes read."""
        linear = chunk.linear
        coord = tuple(o // i for o, i in zip(chunk.offsets, inner, strict=True))
        chunk_bytes = math.prod(inner) * self.dtype.itemsize
        offset, length = (int(v) for v in header.index[linear])
        if not self._chunk_fits(offset, length, chunk_bytes, header.size):
            raise self._corrupt(f"inner chunk {coord} is missing or has the wrong size")
        dst = out[_index(chunk.part, src.offsets, chunk.lengths)]
        within = _index(chunk.part, chunk.offsets, chunk.lengths)
        whole = tuple(chunk.lengths) == tuple(inner)
        expected = header.table[linear]
        want = header.hash_of(linear)
        if self.codec is not None:
            # A compressed chunk is decompressed whole: straight into the destination
            # when it needs all of it, else into scratch.
            direct = whole and dst.flags.c_contiguous
            target = as_bytes(dst) if direct else scratch(chunk_bytes, 0)
            self._read_compressed(fd, offset, length, expected, coord, target, want)
            if not direct:
                dst[...] = target.view(self.dtype).reshape(tuple(inner))[within]
        elif dst.flags.c_contiguous and (not inner or chunk.lengths[1:] == tuple(inner[1:])):
            # The needed rows go straight into the destination; the chunk's other rows
            # (read only to verify its checksum) into scratch: no copy.
            first = chunk.part[0] - chunk.offsets[0] if inner else 0
            row_bytes = chunk_bytes // inner[0] if inner else chunk_bytes
            before = first * row_bytes
            after = chunk_bytes - before - dst.nbytes
            spare = scratch(before + after, 0)
            segments = [spare[:before], as_bytes(dst), spare[before : before + after]]
            self._read_verified(fd, offset, segments, expected, coord, want)
        else:
            target = scratch(chunk_bytes, 0)
            self._read_verified(fd, offset, [target], expected, coord, want)
            dst[...] = target.view(self.dtype).reshape(tuple(inner))[within]
        return length

    def read_run(
        self,
        fd: ReadHandle,
        header: ShardHeader,
        inner: Sequence[int],
        chunks: Sequence[ChunkRead],
        src: Box,
        out: np.ndarray,
    ) -> int | None:
        """:meth:`read_chunk` of each of ``chunks`` in one request, when they are whole
        raw chunks stored back to back whose rows follow each other in ``out`` (a
        C-contiguous array whose rows the chunks fill whole): each lands in place and is
        verified as it would be alone. Returns bytes read, or None (nothing read) when
        the chunks are not such a run."""
        n = len(chunks)
        if self.codec is not None or n < 2 or not inner or not out.flags.c_contiguous:
            return None
        inner = tuple(inner)
        if out.shape[1:] != inner[1:] or any(c.lengths != inner for c in chunks):
            return None
        chunk_bytes = math.prod(inner) * self.dtype.itemsize
        first = int(header.index[chunks[0].linear][0])
        row = chunks[0].part[0] - src.offsets[0]
        for k, chunk in enumerate(chunks):
            offset, length = (int(v) for v in header.index[chunk.linear])
            if (
                offset != first + k * (chunk_bytes + 4)
                or length != chunk_bytes + 4
                or chunk.part[0] - src.offsets[0] != row + k * inner[0]
            ):
                return None
        index_start = header.size - (len(header.index) * 16 + 4)
        if first < header.head or first + n * (chunk_bytes + 4) > index_start:
            return None  # (not where chunks can be: read one by one, and refused there)
        flat = as_bytes(out)
        start = row * (chunk_bytes // inner[0])
        places = [flat[start + k * chunk_bytes : start + (k + 1) * chunk_bytes] for k in range(n)]
        tails = np.empty((n, 4), dtype=np.uint8)
        buffers: list[Any] = [b for k in range(n) for b in (places[k], tails[k])]
        got = fd.readinto(buffers, first)
        for k, chunk in enumerate(chunks):
            coord = tuple(o // i for o, i in zip(chunk.offsets, inner, strict=True))
            if got < (k + 1) * (chunk_bytes + 4):
                raise self._corrupt(f"inner chunk {coord} is truncated")
            stored = int.from_bytes(tails[k].tobytes(), "little")
            expected = int(header.table[chunk.linear])
            if stored != expected or _crc.crc32c(places[k].data) != stored:
                raise self._corrupt(f"inner chunk {coord} fails its crc32c checksum")
            if header.hashes is not None:  # (a reader that checks a signed checkpoint's)
                want = header.hash_of(chunk.linear)
                self._check_hash(want, f"inner chunk {coord}", places[k], tails[k])
        return n * (chunk_bytes + 4)

    def read_sharded(
        self, block: Sequence[int], inner: Sequence[int], src: Box, out: np.ndarray
    ) -> int:
        """Copy ``src`` (in block coordinates) of a shard into ``out``, reading only the inner
        chunks that intersect it, on the calling thread. Returns bytes read."""
        fd = self.open()
        try:
            header = self.header(fd, block, inner)
            total = header.nbytes
            for chunk in self.chunk_reads(block, inner, src):
                total += self.read_chunk(fd, header, inner, chunk, src, out)
            return total
        finally:
            fd.close()


def _index(at: Sequence[int], origin: Sequence[int], lengths: Sequence[int]) -> Any:
    """The index of the box at ``at`` of ``lengths`` in an array whose origin is at
    ``origin``; it ends with ``...`` so a 0-d array gives a view, not a scalar."""
    return (*(slice(a - o, a - o + n) for a, o, n in zip(at, origin, lengths, strict=True)), ...)


class _Named:
    """An open piece whose ``FileNotFoundError`` names the variable and the file."""

    def __init__(self, handle: ReadHandle, reader: PieceReader) -> None:
        self._handle, self._reader = handle, reader

    def _missing(self) -> CorruptCheckpointError:
        return self._reader._corrupt("a file the index names is missing")

    @property
    def size(self) -> int:
        try:
            return self._handle.size
        except FileNotFoundError:
            raise self._missing() from None

    def readinto(self, buffers: Sequence[Any], offset: int) -> int:
        try:
            return self._handle.readinto(buffers, offset)
        except FileNotFoundError:
            raise self._missing() from None

    def read(self, offset: int, length: int) -> bytes:
        try:
            return self._handle.read(offset, length)
        except FileNotFoundError:
            raise self._missing() from None

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        try:
            self._handle.will_need(runs)
        except FileNotFoundError:
            raise self._missing() from None

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> _Named:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

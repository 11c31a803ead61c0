"""Reading one rank's targets of a load with its I/O workers.

Two passes over the stored pieces a rank needs (:func:`~distckpt.planning.read_plan.plan_reads`):
first the header of every shard it will read (checksum table and shard index, verified),
then the inner chunks, in tasks of at most :data:`TASK_BYTES`, all on the workers.

A target in host memory that can be written in place (a C-contiguous CPU tensor) is read
straight into. Any other target (a GPU tensor; a non-contiguous or conjugate view) is
read a band at a time into a staging slab (:mod:`distckpt.transfer.slabs`), and the
worker that completes a band copies it into the target (asynchronously on a side stream
for a GPU) while the next bands are read; a slab is reused once its copies are done.
Host memory stays within the slab pool whatever the state's size.

If a read fails (a corrupted chunk), the remaining reads are skipped, the running ones
awaited, and the error raised: targets may then be partly filled.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.errors import CorruptCheckpointError, UntrustedCheckpointError
from distckpt.format.piece_reader import ChunkRead, PieceReader, ShardHeader
from distckpt.format.shard_io import EMPTY
from distckpt.format.stored import Pieces, StoredPiece
from distckpt.planning.read_plan import Copy, covered, plan_reads
from distckpt.slices import Box
from distckpt.storage.backend import ReadHandle, Store
from distckpt.transfer import slabs
from distckpt.transfer.arrays import writable_view
from distckpt.transfer.staged import landings
from distckpt.transfer.workers import TaskGroup, interleaved

#: Bytes of inner chunks one task reads.
TASK_BYTES = 8 << 20


@dataclass
class ReadTarget:
    """Fill ``tensor`` (or ``out``, a NumPy array shaped like ``box``, of the stored dtype)
    with the box ``box`` of the stored tensor ``entry`` (its index entry) named ``name``."""

    name: str
    entry: dict[str, Any]
    box: Box
    tensor: torch.Tensor | None = None
    out: np.ndarray | None = None
    stored: Pieces | None = None  # the entry's pieces, if already read
    auth: str | None = None  # the hash algorithm every byte read is checked with


class _Tally:
    """Bytes read from storage, added from the workers."""

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


def read_targets(
    root: Store,
    targets: Sequence[ReadTarget],
    *,
    workers: int,
    on_bytes: Callable[[int], None] | None = None,
    auth: str | None = None,
) -> int:
    """Fill every target, verifying every checksum read; returns the bytes read from
    storage (as stored). ``on_bytes(n)`` counts the target bytes filled. ``auth``: check
    every byte read against the hash (of that algorithm) its signed index records."""
    jobs: list[tuple[ReadTarget, list[Copy[StoredPiece]], np.ndarray | None]] = []
    for t in targets:
        t.auth = auth
        if t.box.empty:
            continue
        if t.stored is None:
            t.stored = Pieces(t.entry, t.name)
        copies = list(plan_reads(t.box, t.stored.covering(t.box)))
        if not covered(t.box, copies):
            raise CorruptCheckpointError(
                f"variable {t.name!r}: the stored pieces do not cover slice {t.box} "
                f"of shape {t.entry['shape']}"
            )
        # Read in place where the target allows it, else through the slabs (None).
        out = t.out if t.out is not None else writable_view(_tensor(t))
        jobs.append((t, copies, out))
    tally = _Tally()
    headers = _read_headers(root, jobs, workers, tally)
    # One worker with nothing to stage reads on this thread (see TaskGroup).
    group = TaskGroup(
        workers, on_bytes, inline=workers == 1 and all(out is not None for _, _, out in jobs)
    )
    used: set[slabs.SlabPool] = set()

    def in_place() -> Iterator[list[tuple[Callable[..., int], tuple[Any, ...]]]]:
        """The tasks of each copy into a target read in place, listed as they are fed."""
        for t, copies, out in jobs:
            if out is not None:
                for copy in copies:
                    yield _copy_tasks(root, t, copy, out, headers, tally)

    try:
        with group:
            # In place first: those never wait for a slab.
            for fn, args in interleaved(in_place(), workers):
                group.submit(fn, *args)
            for t, _, out in jobs:
                if out is None:
                    _submit_staged(group, root, t, headers, tally, used)
    finally:
        for pool in used:
            pool.drain()  # every copy into a target is complete
    return tally.total


def _tensor(t: ReadTarget) -> torch.Tensor:
    assert t.tensor is not None
    return t.tensor


def _reader(root: Store, t: ReadTarget, piece: StoredPiece) -> PieceReader:
    dtype = dtypes.numpy_dtype(t.entry["dtype"])
    auth = None
    if t.auth is not None:
        if piece.hash is None:
            raise UntrustedCheckpointError(
                f"variable {t.name!r}: the signed index records no hash of {piece.file}"
            )
        auth = (t.auth, piece.hash)
    return PieceReader(t.name, root, piece.file, dtype, piece.crc, piece.codec, piece.size, auth)


def _read_headers(
    root: Store,
    jobs: list[tuple[ReadTarget, list[Copy[StoredPiece]], np.ndarray | None]],
    workers: int,
    tally: _Tally,
) -> dict[str, ShardHeader]:
    """The verified header of every shard the copies read, read in parallel."""
    headers: dict[str, ShardHeader] = {}

    def read(reader: PieceReader, block: tuple[int, ...], inner: tuple[int, ...]) -> None:
        fd = reader.open()
        try:
            header = reader.header(fd, block, inner)
        finally:
            fd.close()
        headers[reader.path] = header
        tally.add(header.nbytes)

    group = TaskGroup(workers, inline=workers == 1)
    seen: set[str] = set()
    for t, copies, _ in jobs:
        for copy in copies:
            piece = copy.piece
            if piece.inner is None or piece.file in seen or _whole(root, piece):
                continue
            seen.add(piece.file)
            group.submit(read, _reader(root, t, piece), piece.block, piece.inner)
    group.wait()
    return headers


def _copy_tasks(
    root: Store,
    t: ReadTarget,
    copy: Copy[StoredPiece],
    out: np.ndarray,
    headers: dict[str, ShardHeader],
    tally: _Tally,
) -> list[tuple[Callable[..., int], tuple[Any, ...]]]:
    """The read tasks (function, arguments) of one copy into ``out`` (the target's array,
    or a band's): a plain chunk, or runs of inner chunks of at most :data:`TASK_BYTES`."""
    piece = copy.piece
    reader = _reader(root, t, piece)
    dst = out[copy.dst.slices()]
    if piece.inner is None:
        return [(_read_plain, (reader, piece.block, copy.src, dst, tally))]
    inner = piece.inner
    chunks = reader.chunk_reads(piece.block, inner, copy.src)
    if _whole(root, piece):  # its header is read with it
        return [(_read_chunks, (reader, None, piece, chunks, copy.src, dst, tally))]
    per_task = max(1, TASK_BYTES // max(1, math.prod(inner) * reader.dtype.itemsize))
    header = headers[reader.path]
    return [
        (_read_chunks, (reader, header, piece, chunks[k : k + per_task], copy.src, dst, tally))
        for k in range(0, len(chunks), per_task)
    ]


def _whole(root: Store, piece: StoredPiece) -> bool:
    """Whether to read a shard whole, in one request, header and all: over a network,
    where a request costs more than the bytes of a small shard (one task's at most), a
    shard that small is fetched at once rather than its header first, then its chunks;
    and any shard of a store without ranged reads (each read would fetch it all)."""
    if piece.inner is None:
        return False
    caps = root.capabilities
    return not caps.ranged_reads or (not caps.local_files and piece.size <= TASK_BYTES)


def _read_plain(
    reader: PieceReader, block: tuple[int, ...], src: Box, dst: np.ndarray, tally: _Tally
) -> int:
    tally.add(reader.read_plain(block, src, dst))
    return int(dst.nbytes)


def _will_need(fd: ReadHandle, header: ShardHeader, chunks: list[ChunkRead]) -> None:
    """Announce the task's chunks, each run of adjacent ones at once: a file system starts
    reading them now, an object store fetches each run in one request; the task then
    reads them a chunk at a time (checksumming each while it is in the CPU cache).
    Entries that cannot be right are left to the read to report."""
    spans = sorted((int(header.index[c.linear][0]), int(header.index[c.linear][1])) for c in chunks)
    runs: list[list[int]] = []
    for offset, length in spans:
        if offset == EMPTY or offset + length > header.size:
            continue
        if runs and runs[-1][1] == offset:
            runs[-1][1] = offset + length
        else:
            runs.append([offset, offset + length])
    fd.will_need([(first, end - first) for first, end in runs])


def _read_chunks(
    reader: PieceReader,
    header: ShardHeader | None,
    piece: StoredPiece,
    chunks: list[ChunkRead],
    src: Box,
    dst: np.ndarray,
    tally: _Tally,
) -> int:
    """Read ``chunks`` of ``piece`` into ``dst``; with no ``header`` (see :func:`_whole`),
    fetch the whole shard at once and verify its header from it first."""
    assert piece.inner is not None
    fd = reader.open()
    read = 0
    try:
        if header is None:
            fd.will_need([(0, piece.size)])
            header = reader.header(fd, piece.block, piece.inner)
            read = header.nbytes
        else:
            _will_need(fd, header, chunks)
        run = reader.read_run(fd, header, piece.inner, chunks, src, dst)
        if run is not None:  # the usual case: in one request
            read += run
        else:
            read += sum(reader.read_chunk(fd, header, piece.inner, c, src, dst) for c in chunks)
    finally:
        fd.close()
    tally.add(read)
    return sum(math.prod(c.lengths) for c in chunks) * reader.dtype.itemsize


def _submit_staged(
    group: TaskGroup,
    root: Store,
    t: ReadTarget,
    headers: dict[str, ShardHeader],
    tally: _Tally,
    used: set[slabs.SlabPool],
) -> None:
    """Read a target that cannot be written in place, band by band through the slabs
    (noting the slab pool in ``used``: its copies must be complete before returning)."""
    dtype = dtypes.numpy_dtype(t.entry["dtype"])
    assert t.stored is not None
    for landing in landings(group, _tensor(t), t.box.lengths, dtype.itemsize, used):
        with landing:
            band = landing.band
            staged = landing.region.array[: band.numel * dtype.itemsize]
            staged = staged.view(dtype).reshape(band.lengths)
            where = band.shifted(t.box.offsets)
            for copy in plan_reads(where, t.stored.covering(where)):
                for fn, args in _copy_tasks(root, t, copy, staged, headers, tally):
                    landing.submit(fn, *args)

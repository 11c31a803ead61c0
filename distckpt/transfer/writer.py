"""Writing one rank's share of a save with its I/O workers.

The calling thread only plans and feeds: it cuts every shard into runs of consecutive
inner chunks (at most :data:`TASK_BYTES` each) and hands them to the workers
(:class:`~distckpt.transfer.workers.TaskGroup`), which checksum, compress if asked, and
write each chunk at its offset in the shard file. The worker that writes a shard's last
run writes its index and checksum table and fsyncs it, so fsyncs overlap too.

Data in host memory is read in place. Staged data (GPU tensors; host views that cannot be
read in place) is copied into a region of a staging slab first, on the calling thread,
asynchronously for GPU tensors: while the workers write the runs already staged, the
next runs are being copied, and when every slab is busy the calling thread waits for the
oldest to be written. Host memory stays within the slab pool whatever the state's size.

Small files (plain chunks, ``zarr.json`` of arrays) are tasks of their own. On a failure
the remaining tasks are skipped, the running ones awaited and every file closed before
the error is raised; the staging directory is then removed by the save.

**Reuse** (an incremental save, :mod:`distckpt.engine.reuse`): a piece whose job names a
:class:`Reuse` (the same piece of the checkpoint the save builds on) is first hashed, a
task per piece, chunk by chunk; at the first chunk whose digest differs from the one
remembered it is known changed and written as usual. A piece whose digest equals the
stored one is copied from there by the store (a hard link on a file system, a
server-side copy on an object store), its size checked; if that fails (the base was
removed meanwhile) it is written. Written pieces are hashed as they are written, so the
next save can decide in turn.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt.errors import CheckpointError
from distckpt.format import shard_io
from distckpt.format.codecs import Codec
from distckpt.format.digests import chunk_digest, piece_digest, plain_digest
from distckpt.format.piece_reader import PieceReader, scratch
from distckpt.format.shard_io import ChunkPart, ShardFile, Stored, stored_chunk
from distckpt.signing import hashes
from distckpt.storage.backend import Store, copying, syncing, write_whole
from distckpt.transfer import slabs
from distckpt.transfer.sources import HostData, Source
from distckpt.transfer.workers import Countdown, TaskGroup, interleaved

log = logging.getLogger("distckpt")

#: Bytes of inner chunks one task writes (and one staging copy moves).
TASK_BYTES = 8 << 20


@dataclass(frozen=True)
class Reuse:
    """The piece of an earlier checkpoint (``store``, file ``key``) that a job's piece may
    be: what it stored, its chunks' digests when this process wrote it (else None), and
    ``origin``, what the new index records as where the piece came from."""

    store: Store
    key: str
    stored: Stored
    chunks: tuple[bytes, ...] | None
    origin: str


@dataclass
class PieceJob:
    """One piece file to write (``key``, in the save's store): ``data`` holds the piece's
    box (origin at its block's); ``reuse``, the earlier piece it may be."""

    id: int
    key: str
    data: Source
    block: tuple[int, ...]
    inner: tuple[int, ...] | None  # None: one plain chunk
    codec: Codec | None = None
    reuse: Reuse | None = None


def write_pieces(
    store: Store,
    jobs: Sequence[PieceJob],
    files: Sequence[tuple[str, bytes]] = (),
    like: dict[str, tuple[Store, str]] | None = None,
    *,
    workers: int,
    on_bytes: Callable[[int], None] | None = None,
    digests: bool = False,
    hashing: str | None = None,
) -> dict[int, Stored]:
    """Write every piece of ``jobs`` and the small ``files`` (key, bytes) into ``store``,
    or take a job's piece from its :class:`Reuse` when its bytes are the same; then make
    them and their names durable (:meth:`Store.persist`, or one
    :meth:`~distckpt.storage.backend.SyncingStore.sync` where the store can).

    ``like`` names, for a small file, a file of an earlier checkpoint that may hold the
    same bytes (taken instead of written when it does).

    Returns {piece id: :class:`~distckpt.format.shard_io.Stored`}, with each piece's
    content digest when ``digests`` (or a job may be reused), and its hash when
    ``hashing`` names an algorithm (a signed save: the workers hash what they write;
    a job reused keeps the hash its :class:`Reuse` knows); ``on_bytes(n)`` counts the
    pieces' data bytes as they are written (from the workers, one call at a time).
    """
    # One worker with nothing to stage writes on this thread (see TaskGroup).
    group = TaskGroup(workers, on_bytes, inline=workers == 1 and not _staged(jobs))
    results: dict[int, Stored] = {}
    shards: list[ShardFile] = []
    digests = digests or any(job.reuse is not None for job in jobs)
    decided = _reuse(store, [job for job in jobs if job.reuse is not None], workers)
    # Small files are made durable together, after the others, where the store can.
    barrier = syncing(store)
    small: list[str] = []

    def feed() -> None:
        for key, data in files:
            small.append(key)
            group.submit(
                _write_small_file, store, key, data, (like or {}).get(key), barrier is None
            )
        sharded: list[PieceJob] = []
        for job in jobs:
            if job.id in decided:
                results[job.id] = decided[job.id]
            elif any(n == 0 for n in job.data.shape):  # nothing stored: no file
                empty = None if hashing is None else hashes.digest(hashing)
                results[job.id] = Stored(0, 0, plain_digest(b"") if digests else None, hash=empty)
            elif job.inner is None:  # small: a device tensor comes over whole, from here
                small.append(job.key)
                group.submit(
                    _write_plain,
                    store,
                    job.id,
                    job.key,
                    job.data.host(),
                    results,
                    digests,
                    barrier is None,
                    hashing,
                )
            else:
                sharded.append(job)
        # Everything read in place first: it never waits for a slab.
        sharded.sort(key=lambda j: j.data.staged)
        plans = (_plan(store, job, results, shards, digests, hashing) for job in sharded)
        runs = ([(plan, run) for run in plan.runs] for plan in plans)
        for plan, run in interleaved(runs, workers):
            group.check()
            _submit_run(group, plan, run)

    try:
        group.drive(feed)
    finally:
        for shard in shards:
            shard.close()  # after a failure, those not finished (a finished one is closed)
    if barrier is not None and small:
        barrier.sync(small)  # every file and name made so far: no directory to fsync
    else:
        store.persist([job.key for job in jobs] + [key for key, _ in files])
    return results


def _reuse(store: Store, jobs: Sequence[PieceJob], workers: int) -> dict[int, Stored]:
    """The jobs whose piece holds the same bytes as their :class:`Reuse`, taken from there
    into ``store``: {piece id: what it stores}. Data read in place is hashed by the workers,
    a task per piece; staged data through the slabs on this thread."""
    taken: dict[int, Stored] = {}
    if not jobs:
        return taken
    group = TaskGroup(workers, inline=workers == 1 and not _staged(jobs))

    def decide(job: PieceJob, same: bool | None = None) -> int:
        if same if same is not None else _unchanged(job):
            got = _take(store, job)
            if got is not None:
                taken[job.id] = got
        return 0

    def feed() -> None:
        for job in jobs:
            if job.data.staged:
                group.submit(decide, job, _unchanged(job))
            else:
                group.submit(decide, job)

    group.drive(feed)
    return taken


def _staged(jobs: Sequence[PieceJob]) -> bool:
    """Whether some job's data passes through the staging slabs (a copy to overlap)."""
    return any(job.data.staged for job in jobs)


def _unchanged(job: PieceJob) -> bool:
    """Whether the job's data has the digest its :class:`Reuse` stored: chunk by chunk,
    stopping at the first chunk known to differ."""
    reuse = job.reuse
    assert reuse is not None and reuse.stored.digest is not None
    data = job.data
    if any(n == 0 for n in data.shape):
        return False  # nothing stored: nothing to take
    if job.inner is None:
        raw = shard_io.as_bytes(np.ascontiguousarray(data.host()))
        return plain_digest(raw) == reuse.stored.digest
    parts = shard_io.chunk_parts(data.shape, job.block, job.inner, data.dtype.itemsize)
    known = reuse.chunks
    if known is not None and len(known) != len(parts):
        return False
    found: list[bytes] = []
    for raw in _raw_chunks(job, parts):
        digest = chunk_digest(raw)
        if known is not None and known[len(found)] != digest:
            return False
        found.append(digest)
    return piece_digest(found) == reuse.stored.digest


def _raw_chunks(job: PieceJob, parts: Sequence[ChunkPart]) -> Iterator[np.ndarray]:
    """Each inner chunk's raw bytes, as a shard would store them, in order."""
    assert job.inner is not None
    data = job.data
    buf = scratch(math.prod(job.inner) * data.dtype.itemsize, 0)
    if isinstance(data, HostData):
        for part in parts:
            yield stored_chunk(data.array[part.slices], part, job.inner, buf)
        return
    pool = slabs.pool(pinned=data.device.type == "cuda")
    for run in _runs(parts, min(TASK_BYTES, pool.slab_bytes)):
        region = pool.take(sum(p.nbytes for p in run))
        event = None
        try:
            event = data.fill(region, run)
            if event is not None:
                event.synchronize()
            offset = 0
            for part in run:
                values = region.array[offset : offset + part.nbytes].view(data.dtype)
                yield stored_chunk(values.reshape(part.lengths), part, job.inner, buf)
                offset += part.nbytes
        finally:
            region.release(event)


def _take(store: Store, job: PieceJob) -> Stored | None:
    """The job's piece copied from its :class:`Reuse` (a hard link, a server-side copy),
    or None when that failed (the earlier piece is gone or not what it was): the piece
    is then written."""
    reuse = job.reuse
    assert reuse is not None
    try:
        target = copying(store)
        if target is None:
            raise TypeError(f"{store.url} does not copy")
        target.copy(reuse.store, reuse.key, job.key, expect=reuse.stored.stamp)
        problem = _differs(store, job)
    except (OSError, TypeError, CheckpointError) as exc:
        problem = f"it could not be taken from {reuse.origin} ({exc})"
    if problem is None:
        return reuse.stored._replace(reused=reuse.origin, stamp=_stamp(store, job.key))
    log.warning("writing %s: %s", job.key, problem)
    with contextlib.suppress(OSError, CheckpointError):
        store.delete(job.key)  # a copy that is not the piece (never written through)
    return None


def _stamp(store: Store, key: str) -> str | None:
    """What a file system says of a piece just stored (its inode, size and time), for a
    later save to check that it was not written in place since. An object is never
    written in place: replaced, its checksum table tells (:func:`_differs`)."""
    target = copying(store)
    if target is None or not store.capabilities.local_files:
        return None
    try:
        return target.stamp(key)
    except (OSError, CheckpointError):
        return None


def _differs(store: Store, job: PieceJob) -> str | None:
    """Why the copy at ``job.key`` is not the piece its base's index describes, or None.

    Its size, and the crc of its checksum table (of a plain chunk's bytes) are checked
    always: an object is only ever replaced whole, so a replaced one is caught. A file
    can also be written in place: without a stamp of it (:func:`_stamp`, taken when this
    process stored it) every chunk of a file is read back, checked, and hashed: its
    content must have the digest of the data (a plain chunk's always is)."""
    reuse = job.reuse
    assert reuse is not None
    want = reuse.stored
    where = reuse.store.where(reuse.key)
    with store.open(job.key) as handle:  # its own size, not the one expected
        size = handle.size
        if size != want.size:
            return f"{where} holds {size} bytes, not {want.size}"
        if job.inner is None:
            head = handle.read(0, size - 4)
        else:
            chunks = math.prod(shard_io.inner_grid(job.block, job.inner))
            head = handle.read(0, 4 * chunks)
    if shard_io.crc32c(head) != want.crc:
        return f"{where} is not the piece its index describes"
    if job.inner is None:
        if plain_digest(head) != want.digest:
            return f"{where} holds other bytes than its index's digest says"
    elif want.stamp is None and store.capabilities.local_files:
        reader = PieceReader(job.key, store, job.key, job.data.dtype, want.crc, job.codec, size)
        found: dict[int, bytes] = {}
        try:
            reader.verify_sharded(
                job.block,
                job.inner,
                job.data.shape,
                on_chunk=lambda linear, raw: found.__setitem__(linear, chunk_digest(raw)),
            )
        except CheckpointError as exc:
            return f"{where} is damaged: {exc}"
        if piece_digest(found[k] for k in sorted(found)) != want.digest:
            return f"{where} holds other bytes than its index's digest says"
    return None


def _write_small_file(
    store: Store,
    key: str,
    data: bytes,
    like: tuple[Store, str] | None = None,
    durable: bool = True,
) -> int:
    """Write a small file (durably, or for a later :meth:`SyncingStore.sync`), or link the
    same bytes from ``like`` (a base's file: a link costs no write-back of its own)."""
    target = None if like is None else copying(store)
    if like is not None and target is not None:
        source, source_key = like
        try:
            if source.read(source_key) == data:
                target.copy(source, source_key, key)
                return 0
        except (OSError, TypeError, CheckpointError):
            with contextlib.suppress(OSError, CheckpointError):
                store.delete(key)
    if durable:
        store.write(key, data)
    else:
        write_whole(store, key, [data], durable=False)
    return 0


def _write_plain(
    store: Store,
    piece: int,
    key: str,
    data: np.ndarray,
    results: dict[int, Stored],
    digests: bool,
    durable: bool = True,
    hashing: str | None = None,
) -> int:
    stored = shard_io.write_plain(store, key, data, fsync=durable, digest=digests, hashing=hashing)
    results[piece] = stored._replace(stamp=_stamp(store, key)) if digests else stored
    return int(data.nbytes)


def _runs(parts: Sequence[ChunkPart], limit: int) -> list[list[ChunkPart]]:
    """Consecutive chunks grouped into runs of at most ``limit`` bytes (one at least)."""
    runs: list[list[ChunkPart]] = []
    size = limit
    for part in parts:
        if size + part.nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(part)
        size += part.nbytes
    return runs


@dataclass
class _Plan:
    """One shard being written: its file, its runs, and the countdown that finishes it."""

    job: PieceJob
    shard: ShardFile
    runs: list[list[ChunkPart]]
    countdown: Countdown
    pool: slabs.SlabPool | None  # staged data: the slabs it passes through


def _plan(
    store: Store,
    job: PieceJob,
    results: dict[int, Stored],
    shards: list[ShardFile],
    digests: bool,
    hashing: str | None,
) -> _Plan:
    assert job.inner is not None
    data = job.data
    itemsize = data.dtype.itemsize
    parts = shard_io.chunk_parts(data.shape, job.block, job.inner, itemsize)
    handle = store.create(job.key, math.prod(job.block) * itemsize)
    shard = ShardFile(
        handle, job.block, job.inner, parts, itemsize, job.codec, digests=digests, hashing=hashing
    )
    shards.append(shard)

    def finish() -> None:
        stored = shard.finish()
        results[job.id] = stored._replace(stamp=_stamp(store, job.key)) if digests else stored

    pool = None if isinstance(data, HostData) else slabs.pool(pinned=data.device.type == "cuda")
    runs = _runs(parts, TASK_BYTES if pool is None else min(TASK_BYTES, pool.slab_bytes))
    return _Plan(job, shard, runs, Countdown(len(runs), finish), pool)


def _submit_run(group: TaskGroup, plan: _Plan, run: list[ChunkPart]) -> None:
    data = plan.job.data
    if isinstance(data, HostData):
        group.submit(_write_run, plan.shard, run, data.array, plan.countdown)
        return
    assert plan.pool is not None
    region = plan.pool.take(sum(p.nbytes for p in run))
    event = None
    try:
        event = data.fill(region, run)
        group.submit(
            _write_staged_run,
            plan.shard,
            run,
            region,
            event,
            data.dtype,
            plan.countdown,
            release=lambda: region.release(event),
        )
    except BaseException:
        region.release(event)
        raise


def _write_run(
    shard: ShardFile, run: list[ChunkPart], data: np.ndarray, countdown: Countdown
) -> int:
    buf = scratch(shard.chunk_bytes, 0)
    together: list[tuple[int, np.ndarray]] = []  # whole chunks read in place: one request
    for part in run:
        values = data[part.slices]
        if part.whole and values.flags.c_contiguous:
            together.append((part.linear, shard_io.as_bytes(values)))
            continue
        shard.write(part.linear, stored_chunk(values, part, shard.inner, buf))  # via ``buf``
    if together:
        shard.write_many(together)
    countdown.done()
    return sum(p.nbytes for p in run)


def _write_staged_run(
    shard: ShardFile,
    run: list[ChunkPart],
    region: slabs.Region,
    event: Any,
    dtype: np.dtype,
    countdown: Countdown,
) -> int:
    if event is not None:
        event.synchronize()
    buf = scratch(shard.chunk_bytes, 0)
    offset = 0
    for part in run:
        values = region.array[offset : offset + part.nbytes].view(dtype).reshape(part.lengths)
        shard.write(part.linear, stored_chunk(values, part, shard.inner, buf))
        offset += part.nbytes
    countdown.done()
    return offset

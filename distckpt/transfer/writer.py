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

**Reuse** (an incremental save): a job that names a :class:`~distckpt.transfer.jobs.Reuse`
is first checked by :mod:`distckpt.transfer.unchanged`, which takes it from the earlier
checkpoint when its bytes are the same; the others are written, hashed as they are
written so that the next save can decide in turn.
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
from distckpt.format.digests import plain_digest
from distckpt.format.piece_reader import scratch
from distckpt.format.shard_io import ChunkPart, ShardFile, Stored, stored_chunk
from distckpt.signing import hashes
from distckpt.storage.backend import Store, copying, syncing, write_whole
from distckpt.transfer import jobs as jobs_mod
from distckpt.transfer import slabs
from distckpt.transfer.jobs import TASK_BYTES, PieceJob, Reuse, runs_of, staged, stamp
from distckpt.transfer.sources import HostData
from distckpt.transfer.staged import Staged
from distckpt.transfer.unchanged import take_unchanged
from distckpt.transfer.workers import Countdown, TaskGroup, interleaved

__all__ = ["TASK_BYTES", "PieceJob", "Reuse", "write_pieces"]

log = logging.getLogger("distckpt")


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
    group = TaskGroup(workers, on_bytes, inline=workers == 1 and not staged(jobs))
    results: dict[int, Stored] = {}
    shards: list[ShardFile] = []
    digests = digests or any(job.reuse is not None for job in jobs)
    decided = take_unchanged(store, [job for job in jobs if job.reuse is not None], workers)
    # Small files are made durable together, after the others, where the store can.
    barrier = syncing(store)
    small: list[str] = []

    with _closing(shards), group:  # the tasks end first, then every shard is closed
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
                digest = plain_digest(b"") if digests else None
                results[job.id] = Stored(0, 0, digest, hash=empty)
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
    if barrier is not None and small:
        barrier.sync(small)  # every file and name made so far: no directory to fsync
    else:
        store.persist([job.key for job in jobs] + [key for key, _ in files])
    return results


@contextlib.contextmanager
def _closing(shards: list[ShardFile]) -> Iterator[None]:
    """Close every shard at the end (after a failure, those not finished; a finished one
    is closed already)."""
    try:
        yield
    finally:
        for shard in shards:
            shard.close()


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
    results[piece] = stored._replace(stamp=stamp(store, key)) if digests else stored
    return int(data.nbytes)


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
        results[job.id] = stored._replace(stamp=stamp(store, job.key)) if digests else stored

    pool = None if isinstance(data, HostData) else slabs.pool(pinned=data.device.type == "cuda")
    limit = jobs_mod.TASK_BYTES if pool is None else min(jobs_mod.TASK_BYTES, pool.slab_bytes)
    runs = runs_of(parts, limit)
    return _Plan(job, shard, runs, Countdown(len(runs), finish), pool)


def _submit_run(group: TaskGroup, plan: _Plan, run: list[ChunkPart]) -> None:
    data = plan.job.data
    if isinstance(data, HostData):
        group.submit(_write_run, plan.shard, run, data.array, plan.countdown)
        return
    assert plan.pool is not None
    with Staged(group, plan.pool.take(sum(p.nbytes for p in run))) as staged:
        staged.event = data.fill(staged.region, run)
        args = (plan.shard, run, staged.region, staged.event, data.dtype, plan.countdown)
        staged.submit(_write_staged_run, *args)


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

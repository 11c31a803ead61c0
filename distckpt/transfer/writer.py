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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distckpt.storage import shard_io
from distckpt.storage.backend import Store
from distckpt.storage.codecs import Codec
from distckpt.storage.piece_reader import scratch
from distckpt.storage.shard_io import ChunkPart, ShardFile, stored_chunk
from distckpt.transfer import slabs
from distckpt.transfer.sources import HostData, Source
from distckpt.transfer.workers import Countdown, TaskGroup, interleaved

#: Bytes of inner chunks one task writes (and one staging copy moves).
TASK_BYTES = 8 << 20


@dataclass
class PieceJob:
    """One piece file to write (``key``, in the save's store): ``data`` holds the piece's
    box (origin at its block's)."""

    id: int
    key: str
    data: Source
    block: tuple[int, ...]
    inner: tuple[int, ...] | None  # None: one plain chunk
    codec: Codec | None = None


def write_pieces(
    store: Store,
    jobs: Sequence[PieceJob],
    files: Sequence[tuple[str, bytes]] = (),
    *,
    workers: int,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[int, tuple[int, int]]:
    """Write every piece of ``jobs`` and the small ``files`` (key, bytes) into ``store``,
    each durably.

    Returns {piece id: (file size, crc)} (see :mod:`distckpt.storage.shard_io`);
    ``on_bytes(n)`` counts the pieces' data bytes as they are written (from the workers,
    one call at a time).
    """
    group = TaskGroup(workers, on_bytes)
    results: dict[int, tuple[int, int]] = {}
    shards: list[ShardFile] = []

    def feed() -> None:
        for key, data in files:
            group.submit(_write_small_file, store, key, data)
        sharded: list[PieceJob] = []
        for job in jobs:
            if any(n == 0 for n in job.data.shape):
                results[job.id] = (0, 0)
            elif job.inner is None:  # small: a device tensor comes over whole, from here
                group.submit(_write_plain, store, job.id, job.key, job.data.host(), results)
            else:
                sharded.append(job)
        # Everything read in place first: it never waits for a slab.
        sharded.sort(key=lambda j: j.data.staged)
        plans = (_plan(store, job, results, shards) for job in sharded)
        runs = ([(plan, run) for run in plan.runs] for plan in plans)
        for plan, run in interleaved(runs, workers):
            group.check()
            _submit_run(group, plan, run)

    try:
        group.drive(feed)
    finally:
        for shard in shards:
            shard.close()  # after a failure, those not finished (a finished one is closed)
    return results


def _write_small_file(store: Store, key: str, data: bytes) -> int:
    store.write(key, data)
    return 0


def _write_plain(
    store: Store, piece: int, key: str, data: np.ndarray, results: dict[int, tuple[int, int]]
) -> int:
    results[piece] = shard_io.write_plain(store, key, data)
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
    store: Store, job: PieceJob, results: dict[int, tuple[int, int]], shards: list[ShardFile]
) -> _Plan:
    assert job.inner is not None
    data = job.data
    itemsize = data.dtype.itemsize
    parts = shard_io.chunk_parts(data.shape, job.block, job.inner, itemsize)
    handle = store.create(job.key, math.prod(job.block) * itemsize)
    shard = ShardFile(handle, job.block, job.inner, parts, itemsize, job.codec)
    shards.append(shard)

    def finish() -> None:
        results[job.id] = shard.finish()

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
    for part in run:
        shard.write(part.linear, stored_chunk(data[part.slices], part, shard.inner, buf))
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

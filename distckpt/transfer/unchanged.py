"""Whether a piece of an incremental save is unchanged, and taking it from the checkpoint
the save builds on when it is (:mod:`distckpt.engine.reuse` says which earlier piece a
piece may be).

A job that names a :class:`~distckpt.transfer.jobs.Reuse` is hashed, a task per piece,
chunk by chunk; at the first chunk whose digest differs from the one remembered it is
known changed and the writer writes it as usual. A piece whose digest equals the stored
one is copied from there by the store (a hard link on a file system, a server-side copy
on an object store), its size and checksum table checked (:func:`differs`); if that
fails (the base was removed meanwhile) it is written.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np

from distckpt.errors import CheckpointError
from distckpt.format import shard_io
from distckpt.format.digests import chunk_digest, piece_digest, plain_digest
from distckpt.format.piece_reader import PieceReader, scratch
from distckpt.format.shard_io import ChunkPart, Stored, stored_chunk
from distckpt.storage.backend import Store, copying
from distckpt.transfer import jobs as jobs_mod
from distckpt.transfer import slabs
from distckpt.transfer.jobs import PieceJob, runs_of, staged, stamp
from distckpt.transfer.sources import HostData
from distckpt.transfer.staged import Staged
from distckpt.transfer.workers import TaskGroup

log = logging.getLogger("distckpt")


def take_unchanged(store: Store, jobs: Sequence[PieceJob], workers: int) -> dict[int, Stored]:
    """The jobs whose piece holds the same bytes as their :class:`Reuse`, taken from there
    into ``store``: {piece id: what it stores}. Data read in place is hashed by the workers,
    a task per piece; staged data through the slabs on this thread."""
    taken: dict[int, Stored] = {}
    if not jobs:
        return taken
    group = TaskGroup(workers, inline=workers == 1 and not staged(jobs))

    def decide(job: PieceJob, same: bool | None = None) -> int:
        if same if same is not None else _unchanged(job):
            got = _take(store, job)
            if got is not None:
                taken[job.id] = got
        return 0

    with group:
        for job in jobs:
            if job.data.staged:
                group.submit(decide, job, _unchanged(job))
            else:
                group.submit(decide, job)
    return taken


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
    for run in runs_of(parts, min(jobs_mod.TASK_BYTES, pool.slab_bytes)):
        with Staged(None, pool.take(sum(p.nbytes for p in run))) as staged:
            staged.event = data.fill(staged.region, run)
            if staged.event is not None:
                staged.event.synchronize()
            offset = 0
            for part in run:
                values = staged.region.array[offset : offset + part.nbytes].view(data.dtype)
                yield stored_chunk(values.reshape(part.lengths), part, job.inner, buf)
                offset += part.nbytes


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
        problem = differs(store, job)
    except (OSError, TypeError, CheckpointError) as exc:
        problem = f"it could not be taken from {reuse.origin} ({exc})"
    if problem is None:
        return reuse.stored._replace(reused=reuse.origin, stamp=stamp(store, job.key))
    log.warning("writing %s: %s", job.key, problem)
    with contextlib.suppress(OSError, CheckpointError):
        store.delete(job.key)  # a copy that is not the piece (never written through)
    return None


def differs(store: Store, job: PieceJob) -> str | None:
    """Why the copy at ``job.key`` is not the piece its base's index describes, or None.

    Its size, and the crc of its checksum table (of a plain chunk's bytes) are checked
    always: an object is only ever replaced whole, so a replaced one is caught. A file
    can also be written in place: without a stamp of it
    (:func:`~distckpt.transfer.jobs.stamp`, taken when this process stored it) every
    chunk of a file is read back, checked, and hashed: its content must have the digest
    of the data (a plain chunk's always is)."""
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

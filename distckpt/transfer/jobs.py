"""What a rank's write is made of: a job per piece file, the earlier piece an incremental
save may take instead (:class:`Reuse`), and what the writer (:mod:`distckpt.transfer.writer`)
and the check for unchanged pieces (:mod:`distckpt.transfer.unchanged`) both use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distckpt.errors import CheckpointError
from distckpt.format.codecs import Codec
from distckpt.format.shard_io import ChunkPart, Stored
from distckpt.storage.backend import Store, copying
from distckpt.transfer.sources import Source

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


def staged(jobs: Sequence[PieceJob]) -> bool:
    """Whether some job's data passes through the staging slabs (a copy to overlap)."""
    return any(job.data.staged for job in jobs)


def stamp(store: Store, key: str) -> str | None:
    """What a file system says of a piece just stored (its inode, size and time), for a
    later save to check that it was not written in place since. An object is never
    written in place: replaced, its checksum table tells
    (:func:`~distckpt.transfer.unchanged.differs`)."""
    target = copying(store)
    if target is None or not store.capabilities.local_files:
        return None
    try:
        return target.stamp(key)
    except (OSError, CheckpointError):
        return None


def runs_of(parts: Sequence[ChunkPart], limit: int) -> list[list[ChunkPart]]:
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

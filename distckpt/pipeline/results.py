"""What a save or a load reports, on each rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SaveResult:
    """What one rank did in a save: where it went, the bytes and files it wrote, the
    bytes and pieces it took from the checkpoint the save built on instead (an
    incremental save: see :mod:`distckpt.engine.reuse`), seconds per phase."""

    path: Path | str  # a path, or the URL of an object store prefix
    bytes_written: int = 0
    files_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    plan_reused: bool = False  # the ranks reused the plan of an earlier save
    bytes_reused: int = 0  # stored bytes of the pieces taken from the base
    pieces_reused: int = 0
    save_id: str | None = None  # this save's identity, recorded in its index
    io_workers: int = 0  # this rank's I/O threads
    io_workers_reason: str = ""  # what chose that count (see distckpt.transfer.workers)


@dataclass
class LoadResult:
    """What one rank restored: matched names, names left over on either side, bytes read
    (as stored: compressed, with shard indexes and checksums) and seconds per phase:
    ``plan`` (read the index, match and check every leaf), ``read`` (read, verify and copy
    into the targets) and ``total`` (both, and the final agreement between ranks).

    ``missing`` is this rank's: names of its state that the checkpoint lacks.
    ``unexpected`` is the job's, the same on every rank: stored names that no rank's state
    holds (a stored name that another rank restores, as another pipeline stage's, is not
    unexpected)."""

    path: Path | str  # a path, or the URL of an object store prefix
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in this rank's state, not stored
    unexpected: list[str] = field(default_factory=list)  # stored, in no rank's state
    bytes_read: int = 0
    bytes_exchanged: int = 0  # received from ranks that read them (see transfer.exchange)
    timings: dict[str, float] = field(default_factory=dict)
    io_workers: int = 0  # this rank's I/O threads
    io_workers_reason: str = ""  # what chose that count (see distckpt.transfer.workers)

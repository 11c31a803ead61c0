"""What a piece reader hands around: the inner chunks a read needs, a shard's verified
header, and the per-thread scratch buffers reads and writes go through."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class ChunkRead(NamedTuple):
    """One inner chunk a read needs: its position in the shard index, its offsets, and
    the part of it needed (offsets and lengths), all in block coordinates."""

    linear: int
    offsets: tuple[int, ...]
    part: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class ShardHeader:
    """A shard's size, checksum table and index (offset, length per inner chunk), verified;
    ``nbytes``: the bytes read for them; ``hashes``: each inner chunk's hash (a reader that
    checks a signed checkpoint's, verified with the rest); ``head``: the bytes of the
    tables at the start of the file (chunks begin after them)."""

    size: int
    table: np.ndarray
    index: np.ndarray
    nbytes: int
    hashes: np.ndarray | None = None
    head: int = 0

    def hash_of(self, linear: int) -> bytes | None:
        """Inner chunk ``linear``'s hash, when the reader checks hashes."""
        return None if self.hashes is None else self.hashes[linear].tobytes()


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

"""Byte ranges of a file, read into or written from a buffer, in tasks for the workers.

A box of a tensor stored whole in C order (a safetensors tensor) is a list of byte runs
of the file (:func:`distckpt.slices.byte_runs`), whose concatenation is the box's own
C-order bytes. :func:`split` cuts such a list into tasks of bounded bytes, each run
keeping its position in the box's buffer; :func:`read_runs` and :func:`write_runs` move
one task's bytes with ``preadv``/``pwritev`` (which release the GIL), straight into or
out of the caller's buffer: no copy on the way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from distckpt.errors import CorruptCheckpointError
from distckpt.storage.backend import Store
from distckpt.storage.beneath import open_resolved

#: Bytes one task moves.
TASK_BYTES = 8 << 20

#: ``(offset in the file, length, position in the buffer)``.
Run = tuple[int, int, int]


def split(
    runs: Iterable[tuple[int, int]], base: int = 0, limit: int = TASK_BYTES
) -> list[list[Run]]:
    """``runs`` (offset, length) at ``base`` in the file, as tasks of at most ``limit``
    bytes (a longer run is cut); buffer positions count from 0 in the runs' order."""
    tasks: list[list[Run]] = []
    size = limit
    pos = 0
    for offset, length in runs:
        done = 0
        while done < length:
            if size >= limit:
                tasks.append([])
                size = 0
            n = min(length - done, limit - size)
            tasks[-1].append((base + offset + done, n, pos))
            done += n
            pos += n
            size += n
    return tasks


def read_runs(path: str, runs: list[Run], out: np.ndarray, what: str) -> int:
    """Read every run of ``path`` into ``out`` (a flat uint8 array) at its position;
    returns the bytes read. A file that ends early is a :class:`CorruptCheckpointError`
    naming ``what`` and the file. ``path`` is where the file leads, resolved and checked
    by the caller (:func:`~distckpt.hf.directory.open_weights`): a link on it now is
    refused, never followed."""
    fd = open_resolved(path)  # resolved and checked by the caller: no link followed now
    try:
        if hasattr(os, "posix_fadvise"):
            for offset, length, _ in runs:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        for offset, length, pos in runs:
            done = 0
            while done < length:
                n = os.preadv(fd, [out[pos + done : pos + length].data], offset + done)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{path}: ends at byte {offset + done}, inside {what} "
                        f"(bytes {offset}..{offset + length})"
                    )
                done += n
    finally:
        os.close(fd)
    return sum(length for _, length, _ in runs)


def read_store_runs(store: Store, key: str, runs: list[Run], out: np.ndarray, what: str) -> int:
    """:func:`read_runs` of the object ``key`` of ``store`` (ranged reads, the runs
    announced first so that a remote store fetches them together)."""
    with store.open(key) as reader:
        reader.will_need([(offset, length) for offset, length, _ in runs])
        for offset, length, pos in runs:
            got = reader.readinto([out[pos : pos + length].data], offset)
            if got < length:
                raise CorruptCheckpointError(
                    f"{store.where(key)}: ends at byte {offset + got}, inside {what} "
                    f"(bytes {offset}..{offset + length})"
                )
    return sum(length for _, length, _ in runs)


def write_runs(fd: int, runs: list[Run], data: np.ndarray) -> int:
    """Write ``data`` (a flat uint8 array) run by run at the runs' offsets of ``fd``."""
    for offset, length, pos in runs:
        done = 0
        while done < length:
            done += os.pwritev(fd, [data[pos + done : pos + length].data], offset + done)
    return sum(length for _, length, _ in runs)

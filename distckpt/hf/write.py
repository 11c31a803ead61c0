"""The write step of :mod:`distckpt.hf.save`: each rank's bytes into the weights files.

Two kinds of destination:

* **Files** (a store with ``local_files``: a local or shared file system): the
  coordinator has created every file at its full size; each rank opens the files its
  boxes fall in and writes them at their offsets (``pwrite``), several ranks into one
  file at once.
* **Objects** (S3, Azure, GCS, a plug-in store): an object has one writer. Each file is
  given to one rank, which creates it (:meth:`~distckpt.storage.backend.Store.create`),
  writes its header and the boxes it holds, and receives the other boxes of the file from
  the ranks holding them (:func:`exchange`), in rounds of messages of at most
  :func:`unit_bytes` per pair of ranks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt import dtypes
from distckpt.format.shard_io import as_bytes
from distckpt.slices import Box, byte_runs, c_order_bands
from distckpt.storage.backend import Store, WriteHandle
from distckpt.storage.beneath import Beneath
from distckpt.storage.fsutil import regular
from distckpt.transfer import ranges, slabs
from distckpt.transfer.sources import HostData, StagedData, source_for
from distckpt.transfer.staged import Staged
from distckpt.transfer.workers import TaskGroup, interleaved

#: The most bytes a rank sends to all its peers, or receives, in one round.
ROUND_BYTES = 64 << 20


def unit_bytes(size: int) -> int:
    """The largest message one rank sends another in a round, for ``size`` ranks: each
    rank then holds at most :data:`ROUND_BYTES` of messages to send and as many received."""
    return max(1 << 20, ROUND_BYTES // max(1, size - 1))


@dataclass
class BoxWrite:
    """One box of a tensor, ``local`` (its leaf name on the rank that holds it), at
    ``offset`` (of the tensor) in ``file``."""

    local: str
    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    box: Box

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    def runs(self, band: Box | None = None) -> list[list[ranges.Run]]:
        """The file's runs of the box (or of ``band``, a box within it, in its own
        coordinates), as write tasks; positions count from 0 in C order."""
        where = self.box if band is None else band.shifted(self.box.offsets)
        return ranges.split(byte_runs(self.shape, where, self.itemsize), self.offset)


#: A band of a box (in the box's coordinates) travelling from its holder to the file's
#: writer.
Piece = tuple[BoxWrite, Box]


@dataclass
class Work:
    """What one rank does in the write step."""

    create: list[tuple[str, int, bytes]] = field(default_factory=list)  # name, size, header
    writes: list[BoxWrite] = field(default_factory=list)  # from this rank's own state
    copies: list[tuple[str, list[tuple[str, int]]]] = field(default_factory=list)  # export
    #: ``(sender, receiver)``: the messages of the pairs this rank is in, in round order.
    messages: dict[tuple[int, int], list[list[Piece]]] = field(default_factory=dict)
    #: The rounds of the exchange (the same on every rank).
    rounds: int = 0


class Files:
    """The weights files as this rank writes them at offsets: ``.<name>.tmp-<token>``,
    created by the coordinator; each opened at first use (never through a link, and a
    regular file only), fsynced and closed by :meth:`close`."""

    def __init__(self, root: Beneath, token: str) -> None:
        self.root, self.token = root, token
        self.fds: dict[str, int] = {}

    def open(self, name: str) -> None:
        if name not in self.fds:
            temp = temporary_name(name, self.token)
            fd = self.root.open(temp, os.O_WRONLY | os.O_NONBLOCK)
            self.fds[name] = regular(fd, self.root.where(temp))

    def write(self, name: str, runs: list[ranges.Run], data: np.ndarray) -> int:
        return ranges.write_runs(self.fds[name], runs, data)

    def close(self, ok: bool) -> None:
        try:
            for fd in self.fds.values():
                if ok:
                    os.fsync(fd)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def temporary_name(name: str, token: str) -> str:
    """The name a weights file is written under before it is renamed to ``name``."""
    return f".{name}.tmp-{token}"


class Objects:
    """The objects this rank writes in a store, each created with its header by the
    constructor, made visible (or abandoned) by :meth:`close`. A failure to create them
    is kept, not raised, and raised by every later write: the rank still takes part in
    the exchange, which its peers wait on."""

    def __init__(self, store: Store, create: Sequence[tuple[str, int, bytes]]) -> None:
        self.handles: dict[str, WriteHandle] = {}
        self.error: BaseException | None = None
        try:
            for name, size, header in create:
                handle = self.handles[name] = store.create(name, size_hint=size)
                handle.write([header], 0)
        except Exception as exc:
            self.error = exc

    def open(self, name: str) -> None:
        if self.error is not None:
            raise self.error
        if name not in self.handles:
            raise AssertionError(f"{name} is written by another rank")

    def write(self, name: str, runs: list[ranges.Run], data: np.ndarray) -> int:
        self.open(name)
        handle = self.handles[name]
        return sum(handle.write([data[pos : pos + n]], offset) for offset, n, pos in runs)

    def close(self, ok: bool) -> None:
        handles, self.handles = list(self.handles.values()), {}
        ok = ok and self.error is None
        for i, handle in enumerate(handles):
            if not ok:
                handle.abort()
                continue
            try:
                handle.finish()
            except BaseException:
                for rest in handles[i:]:
                    rest.abort()
                raise
        if self.error is not None:
            raise self.error


Sink = Files | Objects


def write_boxes(work: Work, local: dict[str, Any], sink: Sink, workers: int, comm: Any) -> int:
    """save_hf: write this rank's boxes, host data in place and GPU data by bands, and
    take part in every round of the exchange; returns the bytes this rank wrote."""
    group = TaskGroup(workers)
    used: set[slabs.SlabPool] = set()
    written = 0
    ok = False
    try:
        with group:
            try:
                written = _submit_boxes(group, work, local, sink, workers, used)
            finally:
                written += exchange(work.messages, work.rounds, local, sink, group, comm, used)
        ok = True
    finally:
        for pool in used:
            pool.drain()
        sink.close(ok)
    return written


def _submit_boxes(
    group: TaskGroup,
    work: Work,
    local: dict[str, Any],
    sink: Sink,
    workers: int,
    used: set[slabs.SlabPool],
) -> int:
    """Submit the writes of this rank's own boxes; returns their bytes. Host data first,
    file by file in turns: one file's writes take turns in the kernel (its inode lock),
    so each worker keeps mostly to a file of its own."""
    written = 0
    streams: dict[str, list[tuple[str, list[ranges.Run], Any]]] = {}
    staged: list[tuple[StagedData, BoxWrite]] = []
    for w in work.writes:
        source = source_for(local[w.local].tensor, w.local)
        sink.open(w.file)
        written += w.box.numel * w.itemsize
        if isinstance(source, HostData):
            flat = as_bytes(source.array).reshape(-1)
            stream = streams.setdefault(w.file, [])
            stream.extend((w.file, task, flat) for task in w.runs())
        else:
            staged.append((source, w))
    for name, task, flat in interleaved(streams.values(), workers):
        group.submit(sink.write, name, task, flat)
    for source, w in staged:
        _submit_staged(group, sink, source, w, used)
    return written


def _submit_staged(
    group: TaskGroup, sink: Sink, source: StagedData, w: BoxWrite, used: set[slabs.SlabPool]
) -> None:
    pool = _pool(source, used)
    for band in c_order_bands(w.box.lengths, w.itemsize, pool.slab_bytes):
        group.check()
        with Staged(group, pool.take(band.numel * w.itemsize)) as staged:
            staged.event = source.stage(staged.region, band)
            for task in w.runs(band):
                staged.submit(_write_staged, sink, w.file, task, staged.region.array, staged.event)


def _pool(source: StagedData, used: set[slabs.SlabPool]) -> slabs.SlabPool:
    pool = slabs.pool(pinned=source.device.type == "cuda")
    used.add(pool)
    return pool


def _write_staged(
    sink: Sink, name: str, runs: list[ranges.Run], data: np.ndarray, event: Any
) -> int:
    if event is not None:
        event.synchronize()
    return sink.write(name, runs, data)


def exchange(
    messages: dict[tuple[int, int], list[list[Piece]]],
    rounds: int,
    local: dict[str, Any],
    sink: Sink,
    group: TaskGroup,
    comm: Any,
    used: set[slabs.SlabPool],
) -> int:
    """Send the pieces this rank holds for other ranks' files and write those it receives
    for its own, round by round; returns the bytes received. Collective: every rank makes
    every round, decided by ``messages`` alone, even after a failure of its own (it then
    sends zeros, writes nothing more, and raises its first error at the end), so that no
    peer waits for a message that never comes."""
    me = comm.rank
    outgoing = {r: queue for (s, r), queue in messages.items() if s == me}
    incoming = {s: queue for (s, r), queue in messages.items() if r == me}
    error: BaseException | None = None
    received = 0
    for k in range(rounds):
        sends = []
        for peer, queue in outgoing.items():
            if k < len(queue):
                data = np.zeros(_size(queue[k]), np.uint8)
                if error is None:
                    try:
                        _pack(queue[k], local, data, used)
                    except Exception as exc:
                        error = exc
                sends.append((peer, data))
        arriving = [(peer, queue[k]) for peer, queue in incoming.items() if k < len(queue)]
        recvs = [(peer, np.empty(_size(pieces), np.uint8)) for peer, pieces in arriving]
        comm.sendrecv(sends, recvs)
        pending: list[futures.Future[Any]] = []
        for (_, pieces), (_, data) in zip(arriving, recvs, strict=True):
            if error is None:
                try:
                    pending += _unpack(pieces, data, sink, group)
                    received += data.nbytes
                except Exception as exc:
                    error = exc
        futures.wait(pending)  # at most one round's messages held
    if error is not None:
        raise error
    return received


def _size(pieces: list[Piece]) -> int:
    return sum(band.numel * w.itemsize for w, band in pieces)


def _pack(
    pieces: list[Piece], local: dict[str, Any], out: np.ndarray, used: set[slabs.SlabPool]
) -> None:
    """The pieces' bytes, back to back in ``out``."""
    at = 0
    for w, band in pieces:
        n = band.numel * w.itemsize
        source = source_for(local[w.local].tensor, w.local)
        if isinstance(source, HostData):
            flat = as_bytes(source.array).reshape(-1)
            for offset, length in byte_runs(w.box.lengths, band, w.itemsize):
                out[at : at + length] = flat[offset : offset + length]
                at += length
            continue
        region = _pool(source, used).take(n)
        try:
            event = source.stage(region, band)
            if event is not None:
                event.synchronize()
            out[at : at + n] = region.array[:n]
        finally:
            region.release()
        at += n


def _unpack(
    pieces: list[Piece], data: np.ndarray, sink: Sink, group: TaskGroup
) -> list[futures.Future[Any]]:
    """Hand the writes of a received message to the workers."""
    submitted = []
    at = 0
    for w, band in pieces:
        n = band.numel * w.itemsize
        part = data[at : at + n]
        submitted += [group.submit(sink.write, w.file, task, part) for task in w.runs(band)]
        at += n
    return submitted

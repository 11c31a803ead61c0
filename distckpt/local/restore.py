"""Restoring from the node-local tier: which step the surviving nodes hold whole, and
each rank's partitions fetched from whichever rank holds them.

1. **Choose** (*one allgather*, :mod:`distckpt.local.choose`): each rank lists the
   committed saves its node directory holds (:func:`distckpt.local.files.survey`) and
   whose partitions they are. A save is *whole* when every rank of the job that saved it
   is held by some surviving rank, original or replica. Every rank picks the same one:
   the newest whole save newer than the newest persistent checkpoint, or none.
2. **Read the manifests** (*one allgather*): the first holder of each saved rank reads
   its manifest; from all of them every rank builds an index of the step, as a
   persistent checkpoint's, so the restore matches names, kinds, shapes and dtypes and
   reshards exactly as :func:`distckpt.load` does.
3. **Fetch** (*one allgather of requests, then rounds of point-to-point sends*): each rank
   asks, for every stored piece that intersects a box it restores, a rank that holds it
   (itself when it can, else one spread over the holders) for the intersection. Data
   travels in messages of at most :data:`~distckpt.local.messages.MESSAGE_BYTES`.

What is checked is what is copied: a piece is read (``pread``, never mapped: another
process may truncate or rewrite the file meanwhile) into memory of this process, the
target's own when the piece fills a contiguous part of it, and its crc32c is computed
over those bytes, from which every copy is then made.

The restore works on any world size: boxes are cut as needed, and per-rank values go to
rank ``r`` from saved rank ``r % saved_world``, as in a persistent restore.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.errors import CorruptCheckpointError
from distckpt.format.shard_io import crc32c
from distckpt.local import files, landing
from distckpt.local.choose import Choice
from distckpt.local.manifests import Piece, checked, extent, index_of
from distckpt.local.messages import MESSAGE_BYTES, pack, packed_size
from distckpt.local.nodes import topology
from distckpt.pipeline import RestoreKind, restore
from distckpt.pipeline.matching import assign, prepare
from distckpt.pipeline.options import CheckpointOptions
from distckpt.pipeline.results import LoadResult
from distckpt.slices import Box, c_order_bands
from distckpt.storage.backend import ReadHandle, Store
from distckpt.tiling import tiling_problem
from distckpt.transfer.exchange import aligned
from distckpt.transfer.reader import ReadTarget

log = logging.getLogger("distckpt")

#: Bytes of a piece read (and checksummed while still in the CPU cache) at a time.
READ_STEP = 4 << 20


@dataclass
class _Request:
    """Part of a stored piece that a rank restores: ``box`` of ``piece``, served by
    ``server`` to target ``target`` of the requesting rank."""

    target: int
    server: int
    piece: Piece
    box: Box

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.piece.itemsize


@dataclass
class _Matched:
    """A rank's reads, checked, and the parts of pieces it restores (from itself or
    asked of another rank)."""

    reads: list[ReadTarget]
    fresh: list[tuple[Any, Any]]  # tensors and values to put in place once all is read
    requests: list[_Request]


@dataclass
class LocalStep(RestoreKind["LocalStep", _Matched]):
    """A restorable local step, as :class:`~distckpt.training.session.RestoreSession`
    reads it: an ``index`` like a persistent checkpoint's and a :meth:`load`, a kind of
    the restore pipeline (:mod:`distckpt.pipeline`)."""

    source = "checkpoint"

    store: Store
    choice: Choice
    comm: Communicator
    path: str = ""
    index: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # what the saver kept beside
    stored: Collection[str] = field(default_factory=dict)  # the stored names
    options: CheckpointOptions = field(default_factory=CheckpointOptions)  # the load's
    _pieces: dict[tuple[str, int | None], list[Piece]] = field(default_factory=dict)
    _files: dict[int, ReadHandle] = field(default_factory=dict)  # this node's, by saved rank
    _copies: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # checked copies
    _uses: Counter[tuple[int, int]] = field(default_factory=Counter)  # their copies to come
    _scratch: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    _bad: set[int] = field(default_factory=set)  # saved ranks whose copy here is damaged
    _everyone_bad: list[list[int]] | None = None  # every rank's _bad, after a read

    @classmethod
    def open(cls, store: Store, choice: Choice, comm: Communicator) -> LocalStep:
        """Collective: read the step's manifests (each by its first holder) and index it."""
        step = cls(store, choice, comm)
        step.path = f"{store.where(files.step_dir(choice.step))} (local tier)"
        mine: dict[int, dict[str, Any]] = {}
        error: BaseException | None = None
        try:
            for owner, holders in choice.holders.items():
                if holders[0] == comm.rank:
                    manifest = files.read_manifest(
                        store, choice.step, owner, choice.token, choice.run, choice.world
                    )
                    where = f"{step.path}, saved rank {owner}"
                    extent(checked(manifest, where)[0], where)  # its pieces' bytes: disjoint
                    mine[owner] = manifest
        except Exception as exc:
            error = exc
        raise_if_any_failed(comm, error)
        manifests: dict[int, dict[str, Any]] = {}
        for part in comm.allgather(mine):
            manifests.update(part)
        step.index, step._pieces, step.extra = index_of(manifests, choice.world, step.path)
        step.stored = step.index["variables"]
        step._drop_short_copies(manifests)
        return step

    def _drop_short_copies(self, manifests: dict[int, dict[str, Any]]) -> None:
        """Collective: forget the copies whose data file cannot be read or is shorter than
        its manifest places pieces in (each rank checks those of its node), so no piece is
        allocated for bytes not stored and the replicas on other nodes are read instead; a
        saved rank that no whole copy is left of is an error on every rank, naming why."""
        short: dict[int, str] = {}
        for owner, holders in self.choice.holders.items():
            if self.comm.rank not in holders:
                continue
            where = f"saved rank {owner}"
            end = extent(checked(manifests[owner], where)[0], where)
            key = files.data_key(self.choice.step, owner, self.choice.token)
            try:
                with self.store.open(key) as handle:
                    size = handle.size
            except OSError as exc:
                short[owner] = f"{self.store.where(key)} cannot be read ({exc})"
                continue
            if size < end:
                short[owner] = (
                    f"its data file is {size} bytes, its manifest places pieces up to {end}"
                )
        everyone = self.comm.allgather(short)
        if not any(everyone):
            return
        why = "is shorter than its manifest says, or cannot be read"
        if not self._drop_copies(self.comm, [sorted(found) for found in everyone], why):
            detail = next(f"saved rank {o}: {d}" for found in everyone for o, d in found.items())
            raise CorruptCheckpointError(f"{self.path}: no node holds a whole copy ({detail})")

    # ------------------------------------------------------------ reading

    def load(
        self, state: dict[str, Any], comm: Communicator, options: CheckpointOptions
    ) -> LoadResult:
        """Fill ``state`` from this step, as :func:`distckpt.load` does from a persistent
        checkpoint with ``options`` (but ``io_workers``: reads are ``pread`` of local
        files, the page cache does the work); collective."""
        self.options = options
        return restore(comm, self, state)

    def read_metadata(self, comm: Communicator) -> LocalStep:
        """The step itself: :meth:`open` read its manifests."""
        return self

    def match(
        self, comm: Communicator, source: LocalStep, state: dict[str, Any], result: LoadResult
    ) -> _Matched | None:
        """This rank's reads, and the parts of pieces it asks each holder for; None when
        strict and a name is missing."""
        rank, size = comm.rank, comm.size
        prepared = prepare(state, self.index, result, rank, size, self.options, located=False)
        if prepared is None:
            return None
        reads = prepared.reads
        requests = [r for i, t in enumerate(reads) for r in self._requests(i, t, comm.rank)]
        return _Matched(reads, prepared.fresh, requests)

    def offer(self, comm: Communicator, matched: _Matched) -> Any:
        """What this rank asks of other ranks (the job's unexpected names travel with it)."""
        return [
            (r.server, r.piece.owner, r.piece.index, r.box.offsets, r.box.lengths)
            for r in matched.requests
            if r.server != comm.rank
        ]

    def read(
        self,
        comm: Communicator,
        source: LocalStep,
        matched: _Matched,
        offers: list[Any],
        result: LoadResult,
    ) -> None:
        """Serve and fetch every request; then every rank learns which copies failed their
        checksum (see :meth:`again`)."""
        self._bad.clear()
        error: BaseException | None = None
        try:
            error = self._fetch(comm, matched.reads, matched.requests, offers, result)
            if error is None:
                for leaf, tensor in matched.fresh:
                    assign(leaf, tensor)
        except Exception as exc:
            error = exc
        finally:
            self._copies.clear()
            self._uses.clear()
            self._scratch = np.empty(0, np.uint8)
            for handle in self._files.values():
                handle.close()
            self._files.clear()
        self._everyone_bad = comm.allgather(sorted(self._bad))
        if error is not None:
            raise error

    def again(self, comm: Communicator) -> bool:
        """Again while a copy failed its checksum and another node has one: every rank's
        saved ranks whose copy on its node failed, forgotten."""
        bad, self._everyone_bad = self._everyone_bad, None
        return bad is not None and any(bad) and self._drop_copies(comm, bad)

    def _drop_copies(
        self, comm: Communicator, bad: list[list[int]], why: str = "fails its checksum"
    ) -> bool:
        """Forget the copies that failed their checksum, or ``why`` (every rank of a node
        reads the same file: the node's copy); whether every saved rank still has a
        holder."""
        topo = topology(comm)
        holders = self.choice.holders
        lost: list[str] = []
        for rank, owners in enumerate(bad):
            node = topo.node_of(rank)
            for owner in owners:
                holders[owner] = [h for h in holders[owner] if topo.node_of(h) != node]
                lost.append(f"saved rank {owner} on node {topo.names[node]}")
        whole = all(holders.get(o) for o in range(self.choice.world))
        if comm.rank == 0:
            log.warning(
                "%s: the copy of %s %s; %s",
                self.path,
                ", ".join(sorted(set(lost))),
                why,
                "reading the replicas on other nodes" if whole else "no other node holds it",
            )
        return whole

    def _requests(self, i: int, t: ReadTarget, rank: int) -> list[_Request]:
        owner = t.entry.get("owner")
        pieces = self._pieces.get((t.name, owner), [])
        holders = self.choice.holders
        distinct: dict[Box, Piece] = {}
        for p in pieces:  # replicas of one box (HSDP): one this rank holds, else the first
            kept = distinct.get(p.box)
            if kept is None or (rank in holders[p.owner] and rank not in holders[kept.owner]):
                distinct[p.box] = p
        out = []
        parts = []
        for box, p in distinct.items():
            part = t.box.intersect(box)
            if part is None:
                continue
            parts.append(part)
            held_by = holders[p.owner]
            server = rank if rank in held_by else held_by[rank % len(held_by)]
            if server == rank:
                out.append(_Request(i, server, p, part))
                continue
            for band in c_order_bands(part.lengths, p.itemsize, MESSAGE_BYTES):
                out.append(_Request(i, server, p, band.shifted(part.offsets)))
        problem = tiling_problem(parts, t.box)
        if problem is not None:
            raise CorruptCheckpointError(
                f"{self.path}: the stored pieces of {t.name!r} do not fill the box {t.box} "
                f"this rank restores exactly once: {problem}"
            )
        return out

    def _open(self, owner: int) -> ReadHandle:
        handle = self._files.get(owner)
        if handle is None:
            key = files.data_key(self.choice.step, owner, self.choice.token)
            try:  # a regular file, reached by no link
                handle = self._files[owner] = self.store.open(key)
            except OSError as exc:  # gone since the survey, or not a file: this copy is lost
                self._bad.add(owner)
                raise CorruptCheckpointError(
                    f"{self.path}: cannot read {self.store.where(key)}: {exc}"
                ) from exc
        return handle

    def _stored(self, p: Piece) -> ReadHandle:
        """The data file that holds piece ``p``, once its size is seen to hold it: no
        buffer is allocated for bytes a manifest declares but no file stores."""
        handle = self._open(p.owner)
        if p.offset + p.nbytes > handle.size:
            self._bad.add(p.owner)
            raise CorruptCheckpointError(
                f"{self.path}: the data of saved rank {p.owner} is truncated: its piece "
                f"{p.index} lies at bytes {p.offset}..{p.offset + p.nbytes} of "
                f"{handle.size}"
            )
        return handle

    def _read(self, p: Piece, into: np.ndarray) -> None:
        """Read piece ``p`` into ``into`` (``p.nbytes`` bytes) and check the crc32c of the
        bytes read, a step at a time while they are in the CPU cache."""
        handle = self._stored(p)
        crc = 0
        for start in range(0, p.nbytes, READ_STEP):
            step = into[start : start + READ_STEP]
            try:
                got = _read_all(handle, step, p.offset + start)
            except OSError as exc:
                self._bad.add(p.owner)
                raise CorruptCheckpointError(
                    f"{self.path}: cannot read the data of saved rank {p.owner}: {exc}"
                ) from exc
            if got != step.size:
                self._bad.add(p.owner)
                raise CorruptCheckpointError(
                    f"{self.path}: the data of saved rank {p.owner} is truncated"
                )
            crc = crc32c(step, crc)
        if crc != p.crc:
            self._bad.add(p.owner)
            raise CorruptCheckpointError(
                f"{self.path}: piece {p.index} of saved rank {p.owner} fails its crc32c"
            )

    def _part(self, p: Piece, box: Box) -> np.ndarray:
        """``box`` of piece ``p`` as bytes shaped ``(*box, itemsize)``, from a checked copy
        of the piece, kept while copies of it are still to come (see :meth:`_fetch`)."""
        key = (p.owner, p.index)
        copy = self._copies.get(key)
        if copy is None:
            self._stored(p)
            if self._uses[key] > 1:
                copy = self._copies[key] = np.empty((*p.box.lengths, p.itemsize), np.uint8)
            else:  # its only copy: into scratch memory, reused (every caller copies at once)
                if self._scratch.size < p.nbytes:
                    self._scratch = np.empty(p.nbytes, np.uint8)
                copy = self._scratch[: p.nbytes].reshape(*p.box.lengths, p.itemsize)
            self._read(p, copy.reshape(-1))
        self._uses[key] -= 1
        if self._uses[key] <= 0:
            self._copies.pop(key, None)
        return copy[box.relative_to(p.box).slices()]

    def _put_own(self, t: ReadTarget, r: _Request, direct: np.ndarray | None) -> None:
        """Restore request ``r``, served by this rank, into target ``t``: straight into
        ``direct`` (see :func:`distckpt.local.landing.direct`) when it can, else from a
        checked copy."""
        if direct is not None:
            self._read(r.piece, direct)
        else:
            landing.put(t, r.box, self._part(r.piece, r.box), r.piece.itemsize)

    def _fetch(
        self,
        comm: Communicator,
        reads: list[ReadTarget],
        requests: list[_Request],
        everyone: list[Any],
        result: LoadResult,
    ) -> BaseException | None:
        """Serve and receive every request, in rounds every rank makes alike; copy what
        this rank holds itself directly. Returns this rank's first error (the rounds go
        on regardless, so no rank is left waiting)."""
        me = comm.rank
        error: BaseException | None = None
        pieces = {(p.owner, p.index): p for ps in self._pieces.values() for p in ps}
        # Messages per (server, requester): requests packed up to MESSAGE_BYTES.
        outgoing: dict[int, list[list[Any]]] = {}
        rounds = 0
        for requester, asked in enumerate(everyone):
            per_server: dict[int, list[list[Any]]] = {}
            for server, owner, index, offsets, lengths in asked:
                p = pieces[(owner, index)]
                box = Box.known(tuple(offsets), tuple(lengths))
                pack(per_server.setdefault(server, []), (p, box), box.numel * p.itemsize)
            for server, messages in per_server.items():
                rounds = max(rounds, len(messages))
                if server == me:
                    outgoing[requester] = messages
        # Copies of a piece made from a checked copy of it: how many, so that the copy is
        # dropped after the last (requests that fill a target directly need none).
        own = [
            (r, landing.direct(reads[r.target], r.box, r.piece)) for r in requests if r.server == me
        ]
        self._uses = Counter((r.piece.owner, r.piece.index) for r, d in own if d is None)
        for messages in outgoing.values():
            self._uses.update((p.owner, p.index) for m in messages for (p, _), _ in m)
        incoming: dict[int, list[list[tuple[_Request, int]]]] = {}
        for r in requests:
            if r.server != me:
                pack(incoming.setdefault(r.server, []), r, r.nbytes)
        exchange = getattr(comm, "sendrecv", None)
        if rounds and exchange is None:
            raise TypeError(f"{type(comm).__name__} has no sendrecv(), which this restore needs")
        for k in range(rounds):
            sends = []
            for requester, messages in outgoing.items():
                if k < len(messages):
                    buffer, error = _fill(self, messages[k], error)
                    sends.append((requester, buffer))
            arriving = [
                (server, np.empty(packed_size(m[k]), np.uint8), m[k])
                for server, m in incoming.items()
                if k < len(m)
            ]
            assert exchange is not None
            exchange(sends, [(server, buffer) for server, buffer, _ in arriving])
            for _, buffer, message in arriving:
                offset = 0
                for r, nbytes in message:
                    data = buffer[offset : offset + nbytes]
                    try:
                        landing.put(reads[r.target], r.box, data, r.piece.itemsize)
                    except Exception as exc:
                        error = error or exc
                    offset = aligned(offset + nbytes)
                result.bytes_exchanged += buffer.size
        for r, direct in own:
            if error is None:
                try:
                    self._put_own(reads[r.target], r, direct)
                    result.bytes_read += r.nbytes
                except Exception as exc:
                    error = exc
        return error


def _fill(
    step: LocalStep, message: list[Any], error: BaseException | None
) -> tuple[np.ndarray, BaseException | None]:
    """One outgoing message: each requested part at an aligned offset. A part that cannot
    be read is left zero and its error returned (the requester's load fails with it)."""
    buffer = np.zeros(packed_size(message), np.uint8)
    offset = 0
    for (p, box), nbytes in message:
        if error is None:
            try:
                part = step._part(p, box)
                buffer[offset : offset + nbytes].reshape(part.shape)[...] = part
            except Exception as exc:
                error = exc
        offset = aligned(offset + nbytes)
    return buffer, error


def _read_all(handle: ReadHandle, into: np.ndarray, offset: int) -> int:
    """Read into all of ``into`` from ``offset`` (short reads resumed); the bytes read,
    fewer only at the end of the file."""
    done = 0
    while done < into.size:
        n = handle.readinto([into[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done

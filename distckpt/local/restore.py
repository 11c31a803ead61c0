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
   (itself when it can, else one spread over the holders) for the intersection. A rank
   serving a piece first checks its crc32c. Data travels in messages of at most
   :data:`~distckpt.local.save.MESSAGE_BYTES`.

The restore works on any world size: boxes are cut as needed, and per-rank values go to
rank ``r`` from saved rank ``r % saved_world``, as in a persistent restore.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distckpt import dtypes, values
from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.engine.load import settle
from distckpt.engine.matching import agree_names, assign, prepare
from distckpt.engine.options import CheckpointOptions
from distckpt.engine.results import LoadResult
from distckpt.errors import CorruptCheckpointError
from distckpt.local import files
from distckpt.local.choose import Choice
from distckpt.local.save import MESSAGE_BYTES, topology
from distckpt.slices import Box, c_order_bands, tiling_problem
from distckpt.storage import wellformed
from distckpt.storage.backend import Store
from distckpt.storage.posix import PosixReader
from distckpt.storage.shard_io import crc32c
from distckpt.storage.stored import stored_dtype
from distckpt.transfer.arrays import writable_view
from distckpt.transfer.exchange import aligned
from distckpt.transfer.reader import ReadTarget

log = logging.getLogger("distckpt")


@dataclass
class _Piece:
    owner: int
    index: int  # its place in the owner's manifest
    box: Box
    offset: int
    nbytes: int
    crc: int
    itemsize: int


@dataclass
class _Request:
    """Part of a stored piece that a rank restores: ``box`` of ``piece``, served by
    ``server`` to target ``target`` of the requesting rank."""

    target: int
    server: int
    piece: _Piece
    box: Box

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.piece.itemsize


def _checked(
    doc: dict[str, Any], where: str
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """A manifest's tensors, values and per-rank values, every field checked (as an
    index entry is, see :mod:`distckpt.storage.wellformed`): names, kinds, dtypes, shapes,
    boxes inside the shape, offsets, sizes that match the box, crc32c values."""
    tensors, plain, per_rank = doc.get("tensors"), doc.get("values"), doc.get("per_rank_values")
    if not (isinstance(tensors, list) and isinstance(plain, dict) and isinstance(per_rank, dict)):
        raise CorruptCheckpointError(f"{where}: malformed manifest")
    for t in tensors:
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or t.get("kind") not in ("tensor", "per_rank"):
            raise CorruptCheckpointError(f"{where}: malformed manifest entry {t!r:.60}")
        try:
            itemsize = stored_dtype(t, name).itemsize
            shape = wellformed.shape_of(t, name, itemsize)
            _, lengths = wellformed.box_of(t.get("box"), name, shape)
            offset, nbytes, crc = t.get("offset"), t.get("nbytes"), t.get("crc")
            if not (wellformed.count(offset) and wellformed.count(crc) and crc < 1 << 32):
                raise wellformed.corrupt(name, "an offset or crc32c that is not a count")
            if nbytes != math.prod(lengths) * itemsize:
                raise wellformed.corrupt(name, f"{nbytes!r:.20} bytes for its box")
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{where}: {exc}") from None
    for table in (plain, per_rank):
        for name, value in table.items():
            values.check(value, name)
    return tensors, plain, per_rank


@dataclass
class LocalStep:
    """A restorable local step, as :class:`~distckpt.training.session.RestoreSession`
    reads it: an ``index`` like a persistent checkpoint's and a :meth:`load`."""

    store: Store
    choice: Choice
    comm: Communicator
    path: str = ""
    index: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # what the saver kept beside
    _pieces: dict[tuple[str, int | None], list[_Piece]] = field(default_factory=dict)
    _maps: dict[int, np.ndarray] = field(default_factory=dict)
    _verified: set[tuple[int, int]] = field(default_factory=set)
    _bad: set[int] = field(default_factory=set)  # saved ranks whose copy here is damaged
    _t_plan: float = 0.0

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
                    mine[owner] = files.read_manifest(store, choice.step, owner, choice.token)
        except Exception as exc:
            error = exc
        raise_if_any_failed(comm, error)
        manifests: dict[int, dict[str, Any]] = {}
        for part in comm.allgather(mine):
            manifests.update(part)
        step._index(manifests)
        return step

    def _index(self, manifests: dict[int, dict[str, Any]]) -> None:
        variables: dict[str, Any] = {}
        where = self.path

        def per_rank(name: str) -> dict[str, Any]:
            entry = variables.setdefault(name, {"kind": "per_rank", "ranks": {}})
            if entry["kind"] != "per_rank":
                raise CorruptCheckpointError(f"{where}: {name!r} is per-rank on some ranks only")
            ranks: dict[str, Any] = entry["ranks"]
            return ranks

        for owner in sorted(manifests):
            doc = manifests[owner]
            tensors, plain, per_rank_values = _checked(doc, f"{where}, saved rank {owner}")
            for i, t in enumerate(tensors):
                name, dtype, shape = t["name"], t["dtype"], t["shape"]
                piece = _Piece(
                    owner,
                    i,
                    Box.from_json(t["box"]),
                    t["offset"],
                    t["nbytes"],
                    t["crc"],
                    dtypes.itemsize(dtype),
                )
                described = {"kind": "tensor", "shape": shape, "dtype": dtype}
                if t["kind"] == "per_rank":
                    per_rank(name)[str(owner)] = {**described, "owner": owner}
                    self._pieces[(name, owner)] = [piece]
                    continue
                entry = variables.setdefault(name, described)
                if entry != described:
                    raise CorruptCheckpointError(
                        f"{where}: variable {name!r} is stored as {entry} by one rank and "
                        f"{described} by rank {owner}"
                    )
                self._pieces.setdefault((name, None), []).append(piece)
            for name, value in plain.items():
                variables.setdefault(name, {"kind": "value", "value": value})
            for name, value in per_rank_values.items():
                per_rank(name)[str(owner)] = {"kind": "value", "value": value}
        for (name, held_by), pieces in self._pieces.items():  # before any tensor of it exists
            entry = variables[name] if held_by is None else variables[name]["ranks"][str(held_by)]
            # Replicas of one box (HSDP) are one; distinct boxes must tile the shape.
            boxes = list({p.box: p for p in pieces})
            problem = tiling_problem(boxes, Box.full(entry["shape"]))
            if problem is not None:
                raise CorruptCheckpointError(
                    f"{where}: variable {name!r}: its pieces do not tile its shape "
                    f"{entry['shape']} exactly once: {problem}"
                )
        self.index = {"world_size": self.choice.world, "variables": variables}
        if manifests:
            extra = manifests[min(manifests)].get("extra") or {}
            if not isinstance(extra, dict):
                raise CorruptCheckpointError(f"{where}: a manifest's 'extra' is not a map")
            self.extra = dict(extra)

    # ------------------------------------------------------------ reading

    def load(
        self, state: dict[str, Any], comm: Communicator, options: CheckpointOptions
    ) -> LoadResult:
        """Fill ``state`` from this step, as :func:`distckpt.load` does from a persistent
        checkpoint with ``options`` (but ``io_workers``: reads are local memory maps, the
        page cache does the work); collective."""
        t0 = time.perf_counter()
        while True:  # again while a copy failed its checksum and another node has one
            result = LoadResult(self.path)
            error, bad = self._load_once(state, comm, options, result)
            if bad is None or not any(bad) or not self._drop_copies(comm, bad):
                break
        result.timings["plan"] = self._t_plan - t0
        result.timings["read"] = time.perf_counter() - self._t_plan
        return settle(comm, result, error, t0)

    def _load_once(
        self,
        state: dict[str, Any],
        comm: Communicator,
        options: CheckpointOptions,
        result: LoadResult,
    ) -> tuple[BaseException | None, list[list[int]] | None]:
        """One attempt of :meth:`load`: this rank's error, and (when the transfers ran)
        every rank's saved ranks whose copy on its node failed its checksum."""
        error: BaseException | None = None
        reads: list[ReadTarget] = []
        fresh: list[Any] = []
        requests: list[_Request] = []
        ready = False  # not if this rank failed, or is strict and lacks a name (see _prepare)
        try:
            prepared = prepare(
                state, self.index, result, comm.rank, comm.size, options, located=False
            )
            if prepared is not None:
                reads, fresh = prepared.reads, prepared.fresh
                requests = [r for i, t in enumerate(reads) for r in self._requests(i, t, comm.rank)]
                ready = True
        except Exception as exc:
            error = exc
        asked = [
            (r.server, r.piece.owner, r.piece.index, r.box.offsets, r.box.lengths)
            for r in requests
            if r.server != comm.rank
        ]
        try:  # the job's unexpected names travel with the requests
            everyone = agree_names(
                comm, asked if ready else None, self.index["variables"], result, options.strict
            )
        except Exception as exc:  # the names error, under strict
            return error or exc, None
        finally:
            self._t_plan = time.perf_counter()
        if any(a is None for a in everyone):
            return error, None
        self._bad.clear()
        try:
            error = self._fetch(comm, reads, requests, everyone, result)
            if error is None:
                for leaf, tensor in fresh:
                    assign(leaf, tensor)
        except Exception as exc:
            error = exc
        finally:
            self._maps.clear()  # unmapped: removed files free their memory
        return error, comm.allgather(sorted(self._bad))

    def _drop_copies(self, comm: Communicator, bad: list[list[int]]) -> bool:
        """Forget the copies that failed their checksum (every rank of a node reads the
        same file: the node's copy); whether every saved rank still has a holder."""
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
                "%s: the copy of %s fails its checksum; %s",
                self.path,
                ", ".join(sorted(set(lost))),
                "reading the replicas on other nodes" if whole else "no other node holds it",
            )
        return whole

    def _requests(self, i: int, t: ReadTarget, rank: int) -> list[_Request]:
        owner = t.entry.get("owner")
        pieces = self._pieces.get((t.name, owner), [])
        holders = self.choice.holders
        distinct: dict[Box, _Piece] = {}
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

    def _piece(self, p: _Piece) -> np.ndarray:
        """Piece ``p`` as bytes shaped ``(*box, itemsize)``, from this node's file (mapped),
        its crc32c checked the first time."""
        if p.owner not in self._maps:
            key = files.data_key(self.choice.step, p.owner, self.choice.token)
            try:
                with self.store.open(key) as handle:  # a regular file, reached by no link
                    assert isinstance(handle, PosixReader)  # the local tier is a directory
                    self._maps[p.owner] = handle.map()
            except OSError as exc:  # gone since the survey, or not a file: this copy is lost
                self._bad.add(p.owner)
                raise CorruptCheckpointError(
                    f"{self.path}: cannot read {self.store.where(key)}: {exc}"
                ) from exc
        data = self._maps[p.owner][p.offset : p.offset + p.nbytes]
        if data.size != p.nbytes:
            self._bad.add(p.owner)
            raise CorruptCheckpointError(
                f"{self.path}: the data of saved rank {p.owner} is truncated"
            )
        if (p.owner, p.index) not in self._verified:
            if crc32c(data) != p.crc:
                self._bad.add(p.owner)
                raise CorruptCheckpointError(
                    f"{self.path}: piece {p.index} of saved rank {p.owner} fails its crc32c"
                )
            self._verified.add((p.owner, p.index))
        return data.reshape(*p.box.lengths, p.itemsize)

    def _part(self, p: _Piece, box: Box) -> np.ndarray:
        return self._piece(p)[box.relative_to(p.box).slices()]

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
                _pack(per_server.setdefault(server, []), (p, box), box.numel * p.itemsize)
            for server, messages in per_server.items():
                rounds = max(rounds, len(messages))
                if server == me:
                    outgoing[requester] = messages
        incoming: dict[int, list[list[tuple[_Request, int]]]] = {}
        for r in requests:
            if r.server != me:
                _pack(incoming.setdefault(r.server, []), r, r.nbytes)
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
                (server, np.empty(_size(m[k]), np.uint8), m[k])
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
                        _put(reads[r.target], r.box, data, r.piece.itemsize)
                    except Exception as exc:
                        error = error or exc
                    offset = aligned(offset + nbytes)
                result.bytes_exchanged += buffer.size
        for r in requests:
            if r.server == me and error is None:
                try:
                    _put(reads[r.target], r.box, self._part(r.piece, r.box), r.piece.itemsize)
                    result.bytes_read += r.nbytes
                except Exception as exc:
                    error = exc
        return error


def _pack(messages: list[list[Any]], item: Any, nbytes: int) -> None:
    """Append ``item`` to the last message, or start a new one when it would pass
    :data:`MESSAGE_BYTES` (each item starts at an aligned offset)."""
    if messages:
        used = sum(aligned(n) for _, n in messages[-1])
        if used + nbytes <= MESSAGE_BYTES:
            messages[-1].append((item, nbytes))
            return
    messages.append([(item, nbytes)])


def _size(message: list[Any]) -> int:
    return sum(aligned(n) for _, n in message)


def _fill(
    step: LocalStep, message: list[Any], error: BaseException | None
) -> tuple[np.ndarray, BaseException | None]:
    """One outgoing message: each requested part at an aligned offset. A part that cannot
    be read is left zero and its error returned (the requester's load fails with it)."""
    buffer = np.zeros(_size(message), np.uint8)
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


def _put(t: ReadTarget, box: Box, data: np.ndarray, itemsize: int) -> None:
    """Copy ``data`` (the bytes of ``box``, C order) into its place in target ``t``."""
    rel = box.relative_to(t.box).slices()
    shape = (*box.lengths, itemsize)
    view = writable_view(t.tensor) if t.tensor is not None else t.out
    if view is not None and view.flags.c_contiguous:
        whole = view.reshape(-1).view(np.uint8).reshape(*t.box.lengths, itemsize)
        whole[rel] = data.reshape(shape)
        return
    assert t.tensor is not None
    region = t.tensor[rel]
    values = torch.from_numpy(np.array(data, copy=True).reshape(-1)).view(region.dtype)
    with torch.no_grad():
        region.copy_(values.reshape(region.shape))

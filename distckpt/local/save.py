"""A save to the node-local tier: each rank writes its own partitions to its node's
directory and sends a copy to its peers on other nodes; one collective confirms the step.

The protocol, in the order every rank runs it (collectives marked *):

1. **Topology** (*allgather of node identities, once per communicator): which ranks share
   a node, and the peers of each rank (:mod:`distckpt.local.nodes`).
2. **Lay out** (every rank): this rank's tensors back to back in one data file, each
   with its box, dtype, offset and crc32c in a manifest; its Python values in the
   manifest too. A plain tensor (the same on every rank that holds it) is written once
   per node, by the lowest rank of the node that holds it (*an allgather of a digest
   of each rank's plain names, and of the names themselves only when the ranks of a
   node hold different ones, as pipeline stages do).
3. **Write and replicate** (*one allgather of sizes, then rounds of point-to-point
   sends*): the I/O workers write the data file while this thread sends it to the peers,
   in messages of at most :data:`MESSAGE_BYTES`, and receives the peers' files, which
   the workers write likewise. Everything is made durable (fsync), then the manifests
   are written.
4. **Confirm** (*one allgather*): every rank learns whether every rank's data and
   replicas are durable. Only then does each rank write its ``done`` mark
   (:mod:`distckpt.local.files`), and the lowest rank of each node removes the node's
   steps beyond the ones kept.

No shared file system is touched and nothing is renamed. A rank that dies before step 4
leaves its step without marks anywhere, so the step never counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import weakref
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.comm.outcome import Failure, share
from distckpt.engine import background
from distckpt.engine.background import Snapped, save_in_background
from distckpt.engine.options import CheckpointOptions, resolve
from distckpt.engine.results import SaveResult
from distckpt.format import seal
from distckpt.format.shard_io import as_bytes, crc32c
from distckpt.items import Leaf, gather_leaves
from distckpt.local import files
from distckpt.local.nodes import Topology, node_identity
from distckpt.storage.backend import Store
from distckpt.transfer.exchange import aligned
from distckpt.transfer.sources import source_for
from distckpt.transfer.workers import TaskGroup

log = logging.getLogger("distckpt")

#: The largest message of a replica transfer (bytes).
MESSAGE_BYTES = 64 << 20

_warned: set[tuple[int, Topology]] = set()  # too many replicas for the nodes: said once
_topologies: weakref.WeakKeyDictionary[Any, Topology] = weakref.WeakKeyDictionary()


def topology(comm: Communicator) -> Topology:
    """Collective the first time for ``comm``: every rank's node (cached)."""
    try:
        return _topologies[comm]
    except (KeyError, TypeError):
        pass
    topo = Topology.of(comm.allgather(node_identity()))
    with contextlib.suppress(TypeError):  # a communicator that cannot be weakly referenced
        _topologies[comm] = topo
    return topo


@dataclass
class Step:
    """What one local save is: its number, its token, the run it belongs to."""

    number: int
    token: str
    run: str
    replicas: int
    keep: int
    extra: dict[str, Any] = field(default_factory=dict)  # kept in the manifests (manager)


@dataclass
class _Layout:
    """This rank's data file: its pieces (offset, host bytes) and its manifest."""

    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)
    size: int = 0
    manifest: dict[str, Any] = field(default_factory=dict)
    messages: list[tuple[int, int]] = field(default_factory=list)  # (offset, length)


def _lay_out(
    leaves: list[Leaf],
    arrays: dict[str, np.ndarray],
    values: dict[str, Any],
    step: Step,
    rank: int,
    world: int,
    node: str,
    plain: set[str],
) -> _Layout:
    layout = _Layout()
    tensors = []
    plain_values: dict[str, Any] = {}
    per_rank_values: dict[str, Any] = {}
    for leaf in leaves:
        if leaf.tensor is None:
            (per_rank_values if leaf.kind == "per_rank" else plain_values)[leaf.name] = values[
                leaf.name
            ]
            continue
        if leaf.replicated and leaf.name not in plain:
            continue  # another rank of this node writes it
        data = as_bytes(arrays[leaf.name])
        assert leaf.box is not None
        tensors.append(
            {
                "name": leaf.name,
                "kind": leaf.kind,
                "dtype": leaf.dtype,
                "shape": list(leaf.shape),
                "box": leaf.box.to_json(),
                "offset": layout.size,
                "nbytes": int(data.size),
            }
        )
        layout.pieces.append((layout.size, data))
        layout.size = aligned(layout.size + int(data.size))
    layout.manifest = {
        "format": files.FORMAT,
        "version": files.VERSION,
        "run": step.run,
        "step": step.number,
        "token": step.token,
        "world": world,
        "owner": rank,
        "node": node,
        "size": layout.size,
        "tensors": tensors,
        "values": plain_values,
        "per_rank_values": per_rank_values,
        "extra": step.extra,
    }
    layout.messages = _messages(layout.pieces)
    return layout


def _plain_names(leaves: list[Leaf]) -> list[str]:
    return sorted(leaf.name for leaf in leaves if leaf.replicated and leaf.tensor is not None)


def _plain_writers(comm: Communicator, topo: Topology, held: list[str] | None) -> set[str]:
    """Collective: the plain tensors this rank writes, of those it ``held`` (None: this
    rank failed). On each node each one is written by the lowest rank that holds it: the
    node's first rank when every rank of the node holds the same ones (data parallelism:
    one allgather of 8 bytes), else as the names say (pipeline stages: one more)."""
    digest = None if held is None else hashlib.blake2b("\0".join(held).encode(), digest_size=8)
    digests = comm.allgather(None if digest is None else digest.digest())
    node = topo.nodes[topo.node_of(comm.rank)]
    if all(len({digests[r] for r in ranks}) == 1 for ranks in topo.nodes):
        return set(held or ()) if node[0] == comm.rank else set()
    names = comm.allgather(held)  # every rank, a failed one too: the decision is shared
    writer: dict[str, int] = {}
    for r in node:  # ascending
        for name in names[r] or ():
            writer.setdefault(name, r)
    return {name for name, r in writer.items() if r == comm.rank}


#: Pieces smaller than this travel several to a message (copied into one buffer);
#: larger ones in messages of their own bytes, sent without a copy.
SMALL_PIECE = 1 << 20


def _messages(pieces: list[tuple[int, np.ndarray]]) -> list[tuple[int, int]]:
    """The (offset, length) in the data file of each message that sends it: a large
    piece in parts of at most :data:`MESSAGE_BYTES`, runs of small ones together."""
    out: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None  # the small pieces gathered so far
    for offset, data in pieces:
        n = int(data.size)
        if n >= SMALL_PIECE:
            if run is not None:
                out.append(run)
                run = None
            out += [(offset + lo, min(MESSAGE_BYTES, n - lo)) for lo in range(0, n, MESSAGE_BYTES)]
            continue
        if run is not None and offset + n - run[0] <= MESSAGE_BYTES:
            run = (run[0], offset + n - run[0])
        else:
            if run is not None:
                out.append(run)
            run = (offset, n)
    if run is not None:
        out.append(run)
    return [(lo, n) for lo, n in out if n]


def _message(layout: _Layout, lo: int, n: int) -> np.ndarray:
    """Bytes ``lo .. lo + n`` of the data file, from the pieces in memory: a view of one
    piece, or a copy of consecutive small ones."""
    for offset, data in layout.pieces:
        if offset <= lo and lo + n <= offset + data.size:
            return data[lo - offset : lo - offset + n]
    out = np.zeros(n, dtype=np.uint8)
    for offset, data in layout.pieces:
        a, b = max(lo, offset), min(lo + n, offset + data.size)
        if a < b:
            out[a - lo : b - lo] = data[a - offset : b - offset]
    return out


def _write_piece(handle: Any, offset: int, data: np.ndarray, entry: dict[str, Any]) -> int:
    entry["crc"] = crc32c(data)
    handle.write([data], offset)
    return int(data.size)


class _Buffers:
    """Receive buffers of :data:`MESSAGE_BYTES`, kept from one save to the next (fresh
    memory costs a first touch of every page on every save), at most ``WINDOW`` per
    source rank in flight: a receiver waits for older writes before taking more."""

    WINDOW = 2
    _free: list[np.ndarray] = []

    def __init__(self) -> None:
        self._busy: list[tuple[Any, np.ndarray]] = []  # (write future, buffer), oldest first

    def take(self, sources: int) -> np.ndarray:
        """A whole buffer; give it back with :meth:`writing` or :meth:`give_back`."""
        while len(self._busy) >= self.WINDOW * max(1, sources):
            future, buffer = self._busy.pop(0)
            futures.wait([future])
            self._free.append(buffer)
        return self._free.pop() if self._free else np.empty(MESSAGE_BYTES, np.uint8)

    def writing(self, future: Any, buffer: np.ndarray) -> None:
        self._busy.append((future, buffer))

    def give_back(self, buffer: np.ndarray) -> None:
        self._free.append(buffer)

    def release(self) -> None:
        """Once every write is done: the buffers go back for the next save."""
        for future, buffer in self._busy:
            futures.wait([future])
            self._free.append(buffer)
        self._busy.clear()
        del self._free[self.WINDOW * 4 :]  # what a few sources need, no more


def _protocol(
    comm: Communicator,
    store: Store,
    step: Step,
    local: Snapped | Failure,
    options: CheckpointOptions,
    error: BaseException | None,
) -> SaveResult:
    result = SaveResult(store.where(files.step_dir(step.number)))
    t0 = time.perf_counter()
    topo = topology(comm)
    rank = comm.rank
    leader = topo.leader(rank)
    peers = topo.peers(rank, step.replicas)
    sources = topo.sources(rank, step.replicas)
    if step.replicas > len(peers) and rank == 0 and (step.replicas, topo) not in _warned:
        _warned.add((step.replicas, topo))
        log.warning(
            "local tier: %d replica(s) asked, but the job spans %d node(s): keeping %d",
            step.replicas,
            len(topo.nodes),
            len(peers),
        )
    layout: _Layout | None = None
    held = None if isinstance(local, Failure) else _plain_names(local[0])
    plain = _plain_writers(comm, topo, held)
    if not isinstance(local, Failure):
        try:
            leaves, arrays, values = local
            layout = _lay_out(
                leaves, arrays, values, step, rank, comm.size, topo.name_of(rank), plain
            )
            if leader:  # a step saved again (the job went back): its old files must go
                files.drop_newer(store, step.number - 1)
        except Exception as exc:
            error = error or exc
    # Every rank learns every transfer (and whether a rank already failed). Files are
    # created only after it: no rank writes into a step its node's leader still removes.
    # (A snapshot that failed on the background thread is a Failure without ``error``.)
    mine = local if isinstance(local, Failure) else (layout and layout.messages)
    plans = share(comm, mine, error)
    assert layout is not None
    owners = (rank, *sources)
    keys = [files.data_key(step.number, o, step.token) for o in owners]
    handles: dict[int, Any] = {}
    group: TaskGroup | None = None
    received: dict[int, dict[str, Any]] = {}
    try:
        group = TaskGroup(resolve(options, store, comm).io_workers)
        store.prepare(keys)
        for o, key in zip(owners, keys, strict=True):
            handles[o] = store.create(key, layout.size if o == rank else None)
        # 3. Write this rank's file while sending it to the peers.
        entries = layout.manifest["tensors"]
        own = [
            group.submit(_write_piece, handles[rank], offset, data, entry)
            for (offset, data), entry in zip(layout.pieces, entries, strict=True)
        ]
    except Exception as exc:
        error = error or exc
        own = []
    try:  # every rank makes every round, whatever failed: the confirmation reports it
        received = _replicate(comm, layout, plans, peers, sources, handles, group, own)
    except Exception as exc:
        error = error or exc
    try:
        if group is not None:
            group.wait()
        if error is None:
            for o in owners:
                handles.pop(o).finish(durable=True)
            manifests = [(rank, layout.manifest), *received.items()]
            for o, manifest in manifests:
                key = files.manifest_key(step.number, o, step.token)
                store.write(key, seal.encode(manifest))
            store.persist(
                keys + [files.manifest_key(step.number, o, step.token) for o, _ in manifests]
            )
            result.bytes_written = layout.size + sum(sum(n for _, n in plans[s]) for s in sources)
    except Exception as exc:
        error = error or exc
    finally:
        try:
            if group is not None:
                group.wait()
        except Exception as exc:
            error = error or exc
        for handle in handles.values():
            handle.abort()
    t_write = time.perf_counter()
    # 4. Confirm: the step counts once every rank's data and replicas are durable.
    raise_if_any_failed(comm, error)
    try:  # from here on the step is committed: nothing may make one rank raise alone
        key = files.mark_key(step.number, step.token, rank)
        files.mark(store, files.Held(step.number, step.token, comm.size, step.run), rank)
        store.persist([key])
    except Exception as exc:  # another mark on this node, or a replica elsewhere, vouches
        log.warning("local tier: could not mark step %d: %s", step.number, exc)
    if leader:
        removed = files.retain(store, step.keep, step.run, below=step.number)
        if removed:
            log.debug("local tier: removed steps %s of %s", removed, store.url)
    result.files_written = len(owners)
    result.timings.update(write=t_write - t0, total=time.perf_counter() - t0)
    return result


def _replicate(
    comm: Communicator,
    layout: _Layout,
    plans: list[list[tuple[int, int]]],
    peers: list[int],
    sources: list[int],
    handles: dict[int, Any],
    group: TaskGroup | None,
    own: list[Any],
) -> dict[int, dict[str, Any]]:
    """Send this rank's file and then its manifest (once ``own``, the writes that
    checksum its pieces, are done) to ``peers``; receive those of ``sources``, their
    files handed to the workers to write (not written where this rank has no handle:
    it failed, and the confirmation will say so). Returns the manifests received.
    Collective: every rank makes the same rounds, decided by ``plans`` alone."""
    exchange = getattr(comm, "sendrecv", None)
    if exchange is None:
        if comm.size == 1:
            return {}
        raise TypeError(
            f"{type(comm).__name__} has no sendrecv(), which saving to the local tier needs"
        )
    rounds = max(len(plan) for plan in plans)
    buffers = _Buffers()
    try:
        for k in range(rounds):
            sends = []
            if k < len(layout.messages) and peers:
                data = _message(layout, *layout.messages[k])
                sends = [(p, data) for p in peers]
            arriving = [(s, buffers.take(len(sources))) for s in sources if k < len(plans[s])]
            recvs = [(s, whole[: plans[s][k][1]]) for s, whole in arriving]
            exchange(sends, recvs)
            for (s, whole), (_, data) in zip(arriving, recvs, strict=True):
                if s in handles and group is not None:
                    future = group.submit(handles[s].write, [data], plans[s][k][0])
                    buffers.writing(future, whole)
                else:
                    buffers.give_back(whole)
        futures.wait(own)  # the manifest carries the crc32c the writes computed
        manifest = np.frombuffer(bytearray(json.dumps(layout.manifest).encode()), np.uint8)
        lengths = {s: np.zeros(1, np.int64) for s in sources}
        exchange([(p, np.array([manifest.size], np.int64)) for p in peers], list(lengths.items()))
        inbox = {s: np.empty(int(lengths[s][0]), np.uint8) for s in sources}
        exchange([(p, manifest) for p in peers], list(inbox.items()))
        return {s: json.loads(inbox[s].tobytes()) for s in sources}
    finally:
        buffers.release()


def save_local(
    state: dict[str, Any],
    store: Store,
    step: Step,
    comm: Communicator,
    options: CheckpointOptions,
    *,
    async_save: bool = False,
    lazy: Any = False,
) -> SaveResult | background.AsyncSave:
    """Save ``state`` as local step ``step`` into this node's ``store``; collective.

    Blocking, or (``async_save``) in the background after a snapshot into the same host
    buffers as a background save to the shared store; ``lazy`` as there. Of ``options``,
    ``allow_pickle`` and ``io_workers`` apply (a local step is never compressed)."""
    allow_pickle = options.allow_pickle
    background.finish_pending()
    error: BaseException | None = None
    local: Snapped | Failure
    if not async_save:
        try:
            leaves, values = gather_leaves(state, allow_pickle)
            arrays = {
                leaf.name: source_for(leaf.tensor, leaf.name).host()
                for leaf in leaves
                if leaf.tensor is not None
            }
            local = (leaves, arrays, values)
        except Exception as exc:
            local, error = Failure.capture(exc, comm.rank), exc
        return _protocol(comm, store, step, local, options, error)

    return save_in_background(
        state,
        comm,
        allow_pickle,
        lazy,
        store.where(files.step_dir(step.number)),
        lambda bg_comm, snapped, error: _protocol(bg_comm, store, step, snapped, options, error),
        yielding=options.yielding(),
    )

"""A save to the node-local tier: each rank writes its own partitions to its node's
directory and sends a copy to its peers on other nodes; one collective confirms the step.

A kind of the save pipeline (:mod:`distckpt.pipeline`: its plan stage is steps 1 and 2
with the sizes of step 3, its write stage step 3, its commit step 4). The protocol, in
the order every rank runs it (collectives marked *):

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
   in messages of at most :data:`~distckpt.local.messages.MESSAGE_BYTES`, and receives
   the peers' files, which the workers write likewise. Everything is made durable
   (fsync), then the manifests are written.
4. **Confirm** (*one allgather*): every rank learns whether every rank's data and
   replicas are durable. Only then does each rank write its ``done`` mark
   (:mod:`distckpt.local.files`), and the lowest rank of each node removes the node's
   steps beyond the ones kept.

No shared file system is touched and nothing is renamed. A rank that dies before step 4
leaves its step without marks anywhere, so the step never counts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distckpt import pipeline
from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.comm.outcome import Failure, share
from distckpt.errors import CorruptCheckpointError
from distckpt.format import seal
from distckpt.format.shard_io import as_bytes, crc32c
from distckpt.items import Leaf, gather_leaves
from distckpt.local import files
from distckpt.local.messages import Buffers, checked_plans, manifest_length, message, split
from distckpt.local.nodes import Topology, topology
from distckpt.pipeline import Clock, SaveKind, background
from distckpt.pipeline.background import Snapped
from distckpt.pipeline.options import CheckpointOptions, resolve_run
from distckpt.pipeline.results import SaveResult
from distckpt.storage.backend import Store
from distckpt.transfer.exchange import aligned
from distckpt.transfer.sources import source_for
from distckpt.transfer.workers import TaskGroup

log = logging.getLogger("distckpt")

_warned: set[tuple[int, Topology]] = set()  # too many replicas for the nodes: said once


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
    layout.messages = split(layout.pieces)
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


def _write_piece(handle: Any, offset: int, data: np.ndarray, entry: dict[str, Any]) -> int:
    entry["crc"] = crc32c(data)
    handle.write([data], offset)
    return int(data.size)


@dataclass
class _Plan:
    """What the ranks agreed on: this rank's data file, every rank's messages, and the
    ranks this rank sends its file to (``peers``) and keeps a replica of (``sources``)."""

    layout: _Layout
    plans: list[list[tuple[int, int]]]
    peers: list[int]
    sources: list[int]
    leader: bool  # the lowest rank of its node

    def owners(self, rank: int) -> tuple[int, ...]:
        """The saved ranks whose files this rank writes: its own, then its sources'."""
        return (rank, *self.sources)


class _LocalSave(SaveKind[Snapped, _Plan]):
    """One save of a local step (steps 2 to 4 of the module doc, as a kind of
    :mod:`distckpt.pipeline`)."""

    def __init__(self, store: Store, step: Step, options: CheckpointOptions) -> None:
        self.store = store
        self.step = step
        self.options = options
        self.where = store.where(files.step_dir(step.number))
        self.result = SaveResult(self.where)
        self.local: Snapped | None = None

    def capture(self, state: dict[str, Any]) -> Snapped:
        leaves, values = gather_leaves(state, self.options.allow_pickle)
        arrays = {
            leaf.name: source_for(leaf.tensor, leaf.name).host()
            for leaf in leaves
            if leaf.tensor is not None
        }
        return (leaves, arrays, values)

    def hosted(self, snapped: Snapped) -> Snapped:
        return snapped

    def describe(self, local: Snapped) -> list[str]:
        self.local = local
        return _plain_names(local[0])

    def plan(
        self, comm: Communicator, described: list[str] | Failure, error: BaseException | None
    ) -> _Plan:
        """Step 2, and the sizes of step 3: every rank learns every transfer (and whether
        a rank already failed)."""
        step, rank = self.step, comm.rank
        topo = topology(comm)
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
        held = None if isinstance(described, Failure) else described
        plain = _plain_writers(comm, topo, held)
        layout: _Layout | None = None
        if held is not None:
            assert self.local is not None
            try:
                leaves, arrays, values = self.local
                node = topo.name_of(rank)
                layout = _lay_out(leaves, arrays, values, step, rank, comm.size, node, plain)
                if leader:  # a step saved again (the job went back): its old files must go
                    files.drop_newer(self.store, step.number - 1)
            except Exception as exc:
                error = error or exc
        # Files are created only after this: no rank writes into a step its node's leader
        # still removes. (A snapshot that failed on the background thread is a Failure
        # without ``error``.)
        mine = described if held is None else (layout and layout.messages)
        plans = checked_plans(share(comm, mine, error))
        assert layout is not None
        return _Plan(layout, plans, peers, sources, leader)

    def write(self, comm: Communicator, plan: _Plan, clock: Clock) -> None:
        """Step 3: write this rank's file while sending it to the peers, receive and write
        theirs, make everything durable. Every rank makes every round, whatever failed
        (the first error is raised at the end, for the confirmation to report)."""
        store, step, rank, layout = self.store, self.step, comm.rank, plan.layout
        owners = plan.owners(rank)
        keys = [files.data_key(step.number, o, step.token) for o in owners]
        handles: dict[int, Any] = {}
        group: TaskGroup | None = None
        received: dict[int, dict[str, Any]] = {}
        error: BaseException | None = None
        try:
            group = TaskGroup(resolve_run(self.options, store, comm).io_workers)
            store.prepare(keys)
            for o, key in zip(owners, keys, strict=True):
                handles[o] = store.create(key, layout.size if o == rank else None)
            entries = layout.manifest["tensors"]
            own = [
                group.submit(_write_piece, handles[rank], offset, data, entry)
                for (offset, data), entry in zip(layout.pieces, entries, strict=True)
            ]
        except Exception as exc:
            error = error or exc
            own = []
        try:  # every rank makes every round, whatever failed: the confirmation reports it
            received = _replicate(
                comm, layout, plan.plans, plan.peers, plan.sources, handles, group, own
            )
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
                sent = sum(sum(n for _, n in plan.plans[s]) for s in plan.sources)
                self.result.bytes_written = layout.size + sent
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
        if error is not None:
            raise error

    def commit(
        self, comm: Communicator, plan: _Plan, report: Any, error: BaseException | None
    ) -> None:
        """Step 4: the step counts once every rank's data and replicas are durable."""
        raise_if_any_failed(comm, error)
        step, store, rank = self.step, self.store, comm.rank
        try:  # from here on the step is committed: nothing may make one rank raise alone
            key = files.mark_key(step.number, step.token, rank)
            files.mark(store, files.Held(step.number, step.token, comm.size, step.run), rank)
            store.persist([key])
        except Exception as exc:  # another mark on this node, or a replica elsewhere, vouches
            log.warning("local tier: could not mark step %d: %s", step.number, exc)
        if plan.leader:
            removed = files.retain(store, step.keep, step.run, below=step.number)
            if removed:
                log.debug("local tier: removed steps %s of %s", removed, store.url)

    def finish(
        self, comm: Communicator, plan: _Plan, committed: None, timings: dict[str, float]
    ) -> SaveResult:
        self.result.files_written = len(plan.owners(comm.rank))
        write = timings["plan"] + timings["write"]
        self.result.timings.update(write=write, total=timings["total"])
        return self.result


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
    mine = layout.manifest
    held = files.Held(mine["step"], mine["token"], mine["world"], mine["run"])
    buffers = Buffers()
    try:
        for k in range(rounds):
            sends = []
            if k < len(layout.messages) and peers:
                data = message(layout.pieces, *layout.messages[k])
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
        inbox = {s: np.empty(manifest_length(lengths[s], s), np.uint8) for s in sources}
        exchange([(p, manifest) for p in peers], list(inbox.items()))
        return {s: _received(inbox[s], s, held) for s in sources}
    finally:
        buffers.release()


def _received(raw: np.ndarray, source: int, held: files.Held) -> dict[str, Any]:
    """The manifest rank ``source`` sent with its replica, checked to be its manifest of
    the save ``held`` before a replica of it is written under its name."""
    where = f"the manifest rank {source} sent"
    try:
        doc = json.loads(raw.tobytes())
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"local tier: {where} is not readable: {exc}") from None
    return files.manifest_of(doc, f"local tier: {where}", held, source)


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
    comm = pipeline.communicator(comm)
    kind = _LocalSave(store, step, options)
    return pipeline.save(kind, state, comm, async_save=async_save, lazy=lazy)

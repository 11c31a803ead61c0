"""``distckpt.load``: fill a state in place from a checkpoint, on any world size.

A kind of the restore pipeline (:mod:`distckpt.pipeline`). Every rank reads the index,
matches its leaves to stored variables by name, checks kind, dtype and shape, and then
reads only the stored pieces that intersect its own boxes, verifying every checksum on
the way (:mod:`distckpt.planning.read_plan`). Ranks need not talk to each other to read.
One collective before reading (the pipeline's names agreement) tells every rank whether
all can read and which stored names no rank restores: ranks may hold different
variables (pipeline stages), so a name is unexpected only when the whole job leaves it;
it also carries each rank's offer to share reads with the ranks that restore the same
targets (:mod:`distckpt.transfer.exchange`). One collective at the end makes every rank
raise if any rank failed, so a job never continues half-restored on some ranks.

Each rank reads with its I/O workers (:mod:`distckpt.transfer.reader`). If a read fails
(a corrupted chunk), the targets may be partly filled with new values; the error names
the variable and the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distckpt import dtypes
from distckpt.comm import Communicator
from distckpt.comm.outcome import announce
from distckpt.engine import reuse
from distckpt.errors import UntrustedCheckpointError
from distckpt.format.index import Index, parse_index, read_index_bytes
from distckpt.pipeline import RestoreKind, communicator, restore
from distckpt.pipeline.matching import Prepared, assign, prepare
from distckpt.pipeline.options import (
    LOAD,
    CheckpointOptions,
    LoadKeywords,
    Resolved,
    merge_or_refuse,
    resolve_run,
)
from distckpt.pipeline.results import LoadResult
from distckpt.progress import progress
from distckpt.signing.keys import TrustedKeys, trusted_keys
from distckpt.signing.signature import signer
from distckpt.signing.trust import check_index
from distckpt.slices import Box
from distckpt.storage.backend import Store
from distckpt.storage.registry import location
from distckpt.transfer import exchange
from distckpt.transfer.reader import ReadTarget, read_targets

if TYPE_CHECKING:
    from typing_extensions import Unpack


def load(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    options: CheckpointOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> LoadResult:
    """Fill ``state`` in place from the checkpoint at ``path``; every rank calls it.

    Tensors, DTensors and :class:`~distckpt.Shard` targets receive their own boxes (copied
    in place); :class:`~distckpt.PerRank` targets receive this rank's saved value; Python
    values (and ``None`` placeholders) are replaced in their dict or list. With
    ``strict=True`` (the default) a name on one side and not the other is an error listing
    them all, raised before anything is read; ``strict=False`` restores what matches and
    reports the rest in the result. Strictness is over the job: ranks may hold different
    variables (pipeline stages), and a stored name is unexpected only when no rank holds
    it; a name is missing when the rank holding it finds it absent from the checkpoint.
    A value saved pickled is unpickled only with ``allow_pickle=True``: unpickling runs code
    from the checkpoint, so pass it only for checkpoints you trust.

    ``options`` (a :class:`~distckpt.CheckpointOptions`) holds the settings; its load
    fields (``strict``, ``allow_pickle``, ``io_workers``) may also be given as keyword
    arguments, which win.

    Each rank reads with ``io_workers`` threads (default: the cores this rank may use, at
    most 8 for GPU tensors, see :mod:`distckpt.transfer.workers`; ``$DISTCKPT_IO_WORKERS``
    overrides it). GPU targets are filled through pinned staging slabs
    (:mod:`distckpt.transfer.slabs`).
    """
    comm = communicator(comm)  # also raises the error of a save nobody waited for
    merged, refused = merge_or_refuse(options, keywords, LOAD, "load")
    return load_indexed(state, resolve_run(merged, path, comm), None, comm, refused=refused)


def load_indexed(
    state: dict[str, Any],
    run: Resolved,
    index: dict[str, Any] | None,
    comm: Communicator,
    *,
    refused: BaseException | None = None,
) -> LoadResult:
    """:func:`load` as ``run`` says (its store, options and I/O workers), with the
    checkpoint's ``index`` already read on every rank (by :func:`read_shared_index`; None:
    read it now), as a restore that loads in several rounds does. ``refused``: this rank's
    arguments were refused (reported on every rank)."""
    return restore(comm, _Indexed(run, index, refused), state)


def read_shared_index(
    store: Store, comm: Communicator, trusted: TrustedKeys | None = None
) -> Index:
    """Collective: the index of the checkpoint at ``store``, read by rank 0 alone and
    broadcast, so that a job of thousands of ranks reads it once from shared storage. A
    failure to read it is raised on every rank. With ``trusted``, rank 0 first checks
    that it is signed by one of those keys, and every file it lists
    (:func:`distckpt.signing.trust.check_index`)."""
    payload = announce(comm, _read_checked, store, trusted)
    index = parse_index(payload, store)
    index.signed_by = None if trusted is None else signer(payload)  # (rank 0 checked it)
    return index


def _read_checked(store: Store, trusted: TrustedKeys | None) -> bytes:
    """Rank 0: the index's bytes, its signature and files checked with ``trusted``."""
    raw = read_index_bytes(store)
    if trusted is not None:
        check_index(raw, store, trusted)  # raised on every rank when it fails
    return raw


def require_signed(index: Mapping[str, Any], trusted: TrustedKeys | None, where: str) -> str | None:
    """The hash algorithm a reader checks pieces with: None without ``trusted``; with it,
    the signed index's (an index read without its signature checked, or one that is not
    a checkpoint's own, a local step's, is refused)."""
    if trusted is None:
        return None
    algorithm = index.get("hash_algorithm")
    if getattr(index, "signed_by", None) is None or not isinstance(algorithm, str):
        raise UntrustedCheckpointError(
            f"{where}: the index was read without checking its signature, which "
            f"{trusted.source} requires"
        )
    return algorithm


@dataclass
class _Matched:
    """This rank's reads, every leaf checked; the run resolved for their tensors (the I/O
    workers depend on where the targets are); its reads by exchange class."""

    prepared: Prepared
    run: Resolved
    kinds: list[list[ReadTarget]]


@dataclass(frozen=True)
class _Source:
    """The checkpoint's index, checked, the hash its pieces are checked with, and the
    stored names (the index's variables)."""

    index: dict[str, Any]
    auth: str | None
    stored: Collection[str]


class _Indexed(RestoreKind[_Source, _Matched]):
    """A restore from a checkpoint's index (:mod:`distckpt.pipeline`): each rank reads
    the pieces its boxes need, sharing with the ranks that restore the same targets."""

    source = "checkpoint"

    def __init__(
        self, run: Resolved, index: dict[str, Any] | None, refused: BaseException | None
    ) -> None:
        self.run = run
        self.options = run.options
        self.index = index  # already read on every rank, or None
        self.refused = refused
        self.path = location(run.store)

    def read_metadata(self, comm: Communicator) -> _Source:
        trusted = trusted_keys(self.options.trusted_keys)
        index = self.index
        if index is None:
            index = read_shared_index(self.run.store, comm, trusted)
            reuse.remember_index(self.run.store, index)  # the base of a later save
        auth = require_signed(index, trusted, self.run.store.url)
        return _Source(index, auth, index["variables"])

    def match(
        self, comm: Communicator, source: _Source, state: dict[str, Any], result: LoadResult
    ) -> _Matched | None:
        if self.refused is not None:
            raise self.refused
        prepared = prepare(
            state, source.index, result, comm.rank, comm.size, self.options, store=self.run.store
        )
        run = self.run
        if prepared is not None:
            run = run.for_tensors(t.tensor for t in prepared.reads)
        result.io_workers = run.io_workers
        result.io_workers_reason = run.workers.reason
        if prepared is None:
            return None
        kinds: list[list[ReadTarget]] = [[], []]
        if exchange.can_exchange(comm):
            kinds = exchange.classes(prepared.reads, prepared.replicated)
        return _Matched(prepared, run, kinds)

    def offer(self, comm: Communicator, matched: _Matched) -> Any:
        """Whether this rank shares reads, and the digests of what it restores
        (:mod:`distckpt.transfer.exchange`)."""
        return (exchange.wanted(), *map(exchange.digest, matched.kinds))

    def read(
        self,
        comm: Communicator,
        source: _Source,
        matched: _Matched,
        offers: list[Any],
        result: LoadResult,
    ) -> None:
        groups = _groups(comm, offers, matched.kinds)
        _read(comm, matched.run, matched.prepared, groups, result, source.auth)


def _groups(
    comm: Communicator, offers: list[Any], kinds: list[list[ReadTarget]]
) -> list[exchange.Group]:
    """Collective: the exchange groups this rank belongs to, made from every rank's
    offer: the ranks that restore the same targets of one class (this rank's ``kinds``)
    read them once."""
    groups: list[exchange.Group] = []
    sharing = exchange.can_exchange(comm) and all(o[0] for o in offers)
    everyone = [o[1:] for o in offers] if sharing else []
    for kind in (exchange.REPLICATED, exchange.OTHER) if everyone else ():
        colors = exchange.colors(everyone, kind)
        if max(colors) < 0:  # nobody shares these targets: no group to make
            continue
        sub = comm.split(colors[comm.rank])  # type: ignore[attr-defined]
        if sub is not None:
            groups.append(exchange.Group(sub, kinds[kind]))
    return groups


def _read(
    comm: Communicator,
    run: Resolved,
    prepared: Prepared,
    groups: list[exchange.Group],
    result: LoadResult,
    auth: str | None = None,
) -> None:
    """Read every prepared target: each rank its own, and a share of those it restores
    like the other members of its ``groups``, then exchanged with them; ``auth``: check
    every byte read against the signed index's hashes of that algorithm."""
    shared = {id(t) for g in groups for t in g.targets}
    mine = [t for t in prepared.reads if id(t) not in shared]
    for g in groups:
        g.units = exchange.plan_units(g.targets, g.comm.size)
        mine += [
            exchange.unit_target(g.targets[u.target], u) for u in g.units if u.owner == g.member
        ]
    error: BaseException | None = None
    total = sum(t.box.numel * dtypes.itemsize(t.entry["dtype"]) for t in mine)
    try:
        label = f"loading {run.store.name} (rank 0's share, {run.workers})"
        with progress(label, total, rank=comm.rank) as bar:
            result.bytes_read = read_targets(
                run.store, mine, workers=run.io_workers, on_bytes=bar.update, auth=auth
            )
    except Exception as exc:
        error = exc
    for g in groups:  # every member learns whether every member read its share
        if all(g.comm.allgather(error is None)):
            result.bytes_exchanged += exchange.exchange(g)
    if error is not None:
        raise error
    for leaf, tensor in prepared.fresh:
        assign(leaf, tensor)


def read_region(
    root: str | os.PathLike[str] | Store,
    name: str,
    entry: dict[str, Any],
    target: Box,
    out: np.ndarray,
    on_bytes: Callable[[int], None] | None = None,
    *,
    io_workers: int | None = None,
) -> int:
    """Fill ``out`` (shaped like ``target``, of the stored dtype) with the box ``target`` of
    the stored tensor ``entry`` of the checkpoint at ``root``, verifying every checksum it
    reads and decompressing compressed pieces. Returns the bytes read (as stored);
    ``on_bytes(n)`` is told the bytes of ``out`` filled as they are. Memory: ``out`` plus
    an inner chunk or two per I/O worker."""
    run = resolve_run(CheckpointOptions(io_workers=io_workers), root)
    read = ReadTarget(name, entry, target, out=out)
    return read_targets(run.store, [read], workers=run.io_workers, on_bytes=on_bytes)

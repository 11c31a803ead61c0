"""``distckpt.load``: fill a state in place from a checkpoint, on any world size.

Every rank reads the index, matches its leaves to stored variables by name, checks kind,
dtype and shape, and then reads only the stored pieces that intersect its own boxes,
verifying every checksum on the way (:mod:`distckpt.planning.read_plan`). Ranks need not
talk to each other to read. One collective before reading (:func:`agree_names`) tells
every rank whether all can read and which stored names no rank restores: ranks may hold
different variables (pipeline stages), so a name is unexpected only when the whole job
leaves it. One collective at the end makes every rank raise if any rank failed, so a job
never continues half-restored on some ranks.

Each rank reads with its I/O workers (:mod:`distckpt.transfer.reader`). If a read fails
(a corrupted chunk), the targets may be partly filled with new values; the error names
the variable and the file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import numpy as np

from distckpt import dtypes
from distckpt.comm import Communicator, auto, raise_if_any_failed
from distckpt.comm.outcome import announce
from distckpt.engine import background, reuse
from distckpt.engine.matching import Prepared, agree_names, assign, prepare
from distckpt.engine.options import (
    LOAD,
    CheckpointOptions,
    LoadKeywords,
    Resolved,
    merge_or_refuse,
    resolve,
)
from distckpt.engine.results import LoadResult
from distckpt.format import index as index_mod
from distckpt.progress import progress
from distckpt.slices import Box
from distckpt.storage.backend import Store
from distckpt.storage.registry import location
from distckpt.transfer import exchange
from distckpt.transfer.reader import ReadTarget, read_targets

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("distckpt")


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

    Each rank reads with ``io_workers`` threads (default: the cores this rank may use,
    see :mod:`distckpt.transfer.workers`; ``$DISTCKPT_IO_WORKERS`` overrides it). GPU
    targets are filled through pinned staging slabs (:mod:`distckpt.transfer.slabs`).
    """
    background.finish_pending()  # also raises the error of a save nobody waited for
    comm = comm or auto()
    merged, refused = merge_or_refuse(options, keywords, LOAD, "load")
    return load_indexed(state, resolve(merged, path, comm), None, comm, refused=refused)


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
    store, opts = run.store, run.options
    result = LoadResult(location(store))
    t0 = time.perf_counter()
    error: BaseException | None = None
    prepared: Prepared | None = None
    try:
        if index is None:
            index = read_shared_index(store, comm)
            reuse.remember_index(store, index)  # the base of a later save
        if refused is not None:
            raise refused
        prepared = prepare(state, index, result, comm.rank, comm.size, opts)
    except Exception as exc:
        error = exc
    try:
        stored = index["variables"] if index is not None else {}
        groups = _agree(comm, stored, prepared, result, opts.strict)
        if groups is not None and prepared is not None:
            _read(comm, store, prepared, groups, result, run.io_workers)
    except Exception as exc:
        error = error or exc
    if prepared is not None:
        result.timings["plan"] = prepared.t_plan - t0
        result.timings["read"] = time.perf_counter() - prepared.t_plan
    return settle(comm, result, error, t0)


def read_shared_index(store: Store, comm: Communicator) -> index_mod.Index:
    """Collective: the index of the checkpoint at ``store``, read by rank 0 alone and
    broadcast, so that a job of thousands of ranks reads it once from shared storage. A
    failure to read it is raised on every rank."""
    payload = announce(comm, lambda: index_mod.read_index_bytes(store))
    return index_mod.parse_index(payload, store)


def settle(
    comm: Communicator, result: LoadResult, error: BaseException | None, t0: float
) -> LoadResult:
    """The end of a load on every rank: raise if any rank failed, else time and log it."""
    raise_if_any_failed(comm, error)
    result.timings["total"] = time.perf_counter() - t0
    if comm.rank == 0:
        log.info(
            "restored %s: %d variables, %d bytes read by rank 0 in %.3fs (%s)",
            result.path,
            len(result.loaded),
            result.bytes_read,
            result.timings["total"],
            ", ".join(f"{k} {v:.3f}s" for k, v in result.timings.items() if k != "total"),
        )
    return result


def _agree(
    comm: Communicator,
    stored: Collection[str],
    prepared: Prepared | None,
    result: LoadResult,
    strict: bool,
) -> list[exchange.Group] | None:
    """Collective, before anything is read, even for a rank whose preparation failed
    (``prepared`` None): one :func:`agree_names` carrying each rank's offer to share
    reads (:mod:`distckpt.transfer.exchange`). Raises the names error under ``strict``;
    returns the exchange groups this rank belongs to, or None when a rank cannot read
    (every rank then skips reading: the load fails on every rank anyway)."""
    sharing = exchange.can_exchange(comm)
    kinds: list[list[ReadTarget]] = [[], []]
    offer = None
    if prepared is not None:
        if sharing:
            kinds = exchange.classes(prepared.reads, prepared.replicated)
        offer = (exchange.wanted(), *map(exchange.digest, kinds))
    offers = agree_names(comm, offer, stored, result, strict)
    if any(o is None for o in offers):
        return None
    groups: list[exchange.Group] = []
    everyone = [o[1:] for o in offers] if sharing and all(o[0] for o in offers) else []
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
    store: Store,
    prepared: Prepared,
    groups: list[exchange.Group],
    result: LoadResult,
    workers: int,
) -> None:
    """Read every prepared target: each rank its own, and a share of those it restores
    like the other members of its ``groups``, then exchanged with them."""
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
        with progress(f"loading {store.name} (rank 0's share)", total, rank=comm.rank) as bar:
            result.bytes_read = read_targets(store, mine, workers=workers, on_bytes=bar.update)
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
    run = resolve(CheckpointOptions(io_workers=io_workers), root)
    read = ReadTarget(name, entry, target, out=out)
    return read_targets(run.store, [read], workers=run.io_workers, on_bytes=on_bytes)

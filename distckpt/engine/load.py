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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.comm import Communicator, auto, raise_if_any_failed
from distckpt.comm.outcome import Failure
from distckpt.engine import background
from distckpt.errors import (
    MissingVariablesError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from distckpt.items import Leaf, flatten
from distckpt.progress import progress
from distckpt.slices import Box
from distckpt.storage import index as index_mod
from distckpt.storage.backend import Store, is_remote, location, resolve
from distckpt.storage.index import Pieces
from distckpt.transfer import exchange
from distckpt.transfer import workers as transfer_workers
from distckpt.transfer.reader import ReadTarget, read_targets
from distckpt.values import decode

log = logging.getLogger("distckpt")


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


@dataclass
class _Prepared:
    """A rank's reads, checked before anything is read, and where they go."""

    reads: list[ReadTarget]
    replicated: list[bool]  # per read: a plain tensor's (the same on every rank)
    fresh: list[tuple[Leaf, Any]]  # tensors and values to put in place once all is read
    t_plan: float


def load(
    state: dict[str, Any],
    path: str | os.PathLike[str],
    comm: Communicator | None = None,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io_workers: int | None = None,
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

    Each rank reads with ``io_workers`` threads (default: the cores this rank may use,
    see :mod:`distckpt.transfer.workers`; ``$DISTCKPT_IO_WORKERS`` overrides it). GPU
    targets are filled through pinned staging slabs (:mod:`distckpt.transfer.slabs`).
    """
    background.finish_pending()  # also raises the error of a save nobody waited for
    comm = comm or auto()
    return load_indexed(
        state,
        resolve(path),
        None,
        comm,
        strict=strict,
        allow_pickle=allow_pickle,
        io_workers=io_workers,
    )


def load_indexed(
    state: dict[str, Any],
    store: Store,
    index: dict[str, Any] | None,
    comm: Communicator,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io_workers: int | None = None,
) -> LoadResult:
    """:func:`load` from ``store`` with its ``index`` already read on every rank (by
    :func:`read_shared_index`; None: read it now), as a restore that loads in several
    rounds does."""
    result = LoadResult(location(store))
    t0 = time.perf_counter()
    error: BaseException | None = None
    prepared: _Prepared | None = None
    workers = 1
    try:
        if index is None:
            index = read_shared_index(store, comm)
        workers = transfer_workers.resolve(io_workers, comm, network=is_remote(store))
        prepared = _prepare(state, index, result, comm.rank, comm.size, strict, allow_pickle)
    except Exception as exc:
        error = exc
    try:
        stored = index["variables"] if index is not None else {}
        groups = _agree(comm, stored, prepared, result, strict)
        if groups is not None and prepared is not None:
            _read(comm, store, prepared, groups, result, workers)
    except Exception as exc:
        error = error or exc
    if prepared is not None:
        result.timings["plan"] = prepared.t_plan - t0
        result.timings["read"] = time.perf_counter() - prepared.t_plan
    return settle(comm, result, error, t0)


def read_shared_index(store: Store, comm: Communicator) -> dict[str, Any]:
    """Collective: the index of the checkpoint at ``store``, read by rank 0 alone and
    broadcast, so that a job of thousands of ranks reads it once from shared storage. A
    failure to read it is raised on every rank."""
    payload: bytes | Failure | None = None
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            payload = index_mod.read_index_bytes(store)
        except Exception as exc:
            error, payload = exc, Failure.capture(exc, comm.rank)
    payload = comm.broadcast(payload, root=0)
    if isinstance(payload, Failure):
        payload.raise_here(comm.rank, error)
    assert isinstance(payload, bytes)
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


def _prepare(
    state: dict[str, Any],
    index: dict[str, Any],
    result: LoadResult,
    rank: int,
    world: int,
    strict: bool,
    allow_pickle: bool,
    *,
    located: bool = True,
) -> _Prepared | None:
    """Match the state's leaves to the index and check every one; restore the values.
    ``located=False``: the index describes the variables but not where their pieces are
    (the node-local tier's), so no :class:`~distckpt.storage.index.Pieces` are made.

    Sets ``result.missing`` and this rank's ``result.unexpected`` (for :func:`agree_names`,
    which makes it the job's). None when ``strict`` and a name is missing: the load fails
    once the job has agreed on the names, so that the error lists the job's unexpected
    names too."""
    stored: dict[str, Any] = index["variables"]
    leaves = flatten(state, allow_pickle=allow_pickle)
    names = {leaf.name for leaf in leaves}
    result.missing = sorted(n for n in names if n not in stored)
    result.unexpected = sorted(n for n in stored if n not in names)
    if strict and result.missing:
        return None
    saved_world = int(index.get("world_size", world))
    # Check every leaf before reading anything.
    jobs: list[tuple[Leaf, dict[str, Any], Pieces | None]] = []
    moved: list[str] = []  # per-rank variables restored on another world size
    for leaf in leaves:
        entry = stored.get(leaf.name)
        if entry is None:
            continue
        if leaf.kind == "per_rank":
            entry = _per_rank_entry(leaf.name, entry, rank, world, saved_world)
            if world != saved_world:
                moved.append(leaf.name)
        check_leaf(leaf, entry)
        # A malformed entry or an unknown codec fails before anything is read.
        stored_tensor = located and entry.get("kind") == "tensor"
        pieces = index_mod.pieces_of(index, entry, leaf.name) if stored_tensor else None
        jobs.append((leaf, entry, pieces))
    if moved and rank == 0:
        log.warning(
            "per-rank variables saved on %d ranks are restored on %d: rank r takes what rank "
            "r %% %d saved (%s)",
            saved_world,
            world,
            saved_world,
            ", ".join(moved),
        )
    prepared = _Prepared([], [], [], 0.0)
    for leaf, entry, pieces in jobs:
        box = target_box(leaf, entry)
        if box is None:  # decoded now (a refused pickle fails here), in place once all is read
            value = decode(entry["value"], allow_pickle=allow_pickle, name=leaf.name)
            prepared.fresh.append((leaf, value))
        elif leaf.tensor is None:  # a None placeholder or a per-rank value slot
            if pieces is not None:
                pieces.check_backed()  # the checkpoint, not the user, says how large
            tensor = torch.empty(box.lengths, dtype=dtypes.torch_dtype(entry["dtype"]))
            prepared.reads.append(ReadTarget(leaf.name, entry, box, tensor, stored=pieces))
            prepared.replicated.append(False)
            prepared.fresh.append((leaf, tensor))
        else:
            prepared.reads.append(ReadTarget(leaf.name, entry, box, leaf.tensor, stored=pieces))
            prepared.replicated.append(leaf.replicated)
        result.loaded.append(leaf.name)
    prepared.t_plan = time.perf_counter()
    return prepared


def _agree(
    comm: Communicator,
    stored: Collection[str],
    prepared: _Prepared | None,
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
    prepared: _Prepared,
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


def agree_names(
    comm: Communicator,
    payload: Any,
    stored: Collection[str],
    result: LoadResult,
    strict: bool,
    source: str = "checkpoint",
) -> list[Any]:
    """Collective: every rank's ``payload`` (in rank order), and ``result.unexpected``
    made the job's: the ``stored`` names that no rank restores (:func:`gather_left`).
    Under ``strict`` it then raises :class:`MissingVariablesError` (this rank's
    ``result.missing``, the job's unexpected names), the same error on every rank when
    only names are unexpected."""
    everyone, result.unexpected = gather_left(comm, payload, sorted(stored), result.unexpected)
    if strict:
        check_names(result.path, result.missing, result.unexpected, source)
    return everyone


def gather_left(
    comm: Communicator, payload: Any, ordered: list[str], left: Collection[str]
) -> tuple[list[Any], list[str]]:
    """Collective: every rank's ``payload`` (in rank order), and the names of ``ordered``
    (sorted, the same on every rank) that every rank leaves; ``left``: those this rank
    leaves.

    Each rank adds to ``payload`` a share (:func:`_share`): nothing when it leaves no
    name, else whichever is smaller of a bitmap of the names it leaves (a bit per name)
    and the 4-byte indices of those it takes. Over N names a rank sends at most N/8
    bytes (a pipeline stage, a round of a restore: 4 bytes per name it takes), a rank
    that takes every name none. A job of one rank does not communicate.
    """
    share = _share(ordered, left)
    everyone = comm.allgather((payload, share)) if comm.size > 1 else [(payload, share)]
    return [p for p, _ in everyone], _left_by_all(ordered, [s for _, s in everyone])


def _share(ordered: list[str], left: Collection[str]) -> tuple[bool, bytes] | None:
    """What this rank tells the others about ``left`` (the names of ``ordered`` it does
    not take): None for none, ``(True, bitmap of left)`` or ``(False, uint32 indices of
    the names it takes)``, whichever is smaller."""
    if not left:
        return None
    left_set = set(left)
    takes = np.fromiter((n not in left_set for n in ordered), dtype=bool, count=len(ordered))
    indices = np.flatnonzero(takes).astype("<u4")
    bitmap = np.packbits(~takes)
    if indices.nbytes < bitmap.nbytes:
        return False, indices.tobytes()
    return True, bitmap.tobytes()


def _left_by_all(ordered: list[str], shares: list[tuple[bool, bytes] | None]) -> list[str]:
    """The names of ``ordered`` that every rank's share says it leaves."""
    taken = np.zeros(len(ordered), dtype=bool)
    for share in shares:
        if share is None:  # that rank takes every name
            return []
        is_bitmap, data = share
        if is_bitmap:
            left = np.unpackbits(np.frombuffer(data, np.uint8), count=len(ordered))
            taken |= ~left.astype(bool)
        else:
            taken[np.frombuffer(data, "<u4")] = True
    return [ordered[i] for i in np.flatnonzero(~taken)]


def check_names(
    path: Path | str, missing: list[str], unexpected: list[str], source: str = "checkpoint"
) -> None:
    """Raise :class:`MissingVariablesError` listing every name on one side only."""
    if not (missing or unexpected):
        return
    parts = []
    if missing:
        parts.append(f"missing from the {source}: " + ", ".join(missing))
    if unexpected:
        parts.append(f"in the {source} but not in the state: " + ", ".join(unexpected))
    raise MissingVariablesError(
        f"{path}: names do not match (pass strict=False for a partial restore); "
        + "; ".join(parts),
        missing,
        unexpected,
    )


def target_box(leaf: Leaf, entry: dict[str, Any]) -> Box | None:
    """The box of the stored tensor that ``leaf`` takes; None for a value."""
    if entry["kind"] == "value":
        return None
    if leaf.tensor is None:  # takes the whole stored tensor
        return Box.full(tuple(entry["shape"]))
    assert leaf.box is not None
    return leaf.box


def _per_rank_entry(
    name: str, entry: dict[str, Any], rank: int, world: int, saved_world: int
) -> dict[str, Any]:
    if entry.get("kind") != "per_rank":
        raise ShapeMismatchError(
            f"variable {name!r} is per-rank in the state but a {entry.get('kind')} "
            "in the checkpoint"
        )
    ranks = entry["ranks"]
    source = rank if world == saved_world else rank % saved_world
    if str(source) not in ranks:
        raise MissingVariablesError(
            f"per-rank variable {name!r} has no entry for rank {source}", [name], []
        )
    return ranks[str(source)]


def check_leaf(leaf: Leaf, entry: dict[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """Raise a clear error when the stored entry cannot fill ``leaf``."""
    kind = entry.get("kind")
    if leaf.tensor is None:
        if kind == "per_rank":
            raise ShapeMismatchError(
                f"variable {leaf.name!r} is per-rank in the checkpoint; "
                "restore it into distckpt.PerRank"
            )
        return entry
    if kind != "tensor":
        raise ShapeMismatchError(
            f"variable {leaf.name!r} is a tensor in the state but a {kind} in the {source}"
        )
    stored_shape = list(entry["shape"])
    if list(leaf.shape) != stored_shape:
        raise ShapeMismatchError(
            f"variable {leaf.name!r}: shape in the state {list(leaf.shape)} does not match the "
            f"shape stored in {source}: {stored_shape}"
        )
    stored_dtype = entry["dtype"]
    assert leaf.tensor is not None
    mine = dtypes.zarr_name(leaf.tensor.dtype, leaf.name)
    if mine != stored_dtype:
        raise ShapeMismatchError(
            f"variable {leaf.name!r}: dtype in the state {mine} does not match the dtype stored "
            f"in {source}: {stored_dtype}"
        )
    return entry


def assign(leaf: Leaf, value: Any) -> None:
    parent = leaf.parent
    if leaf.kind == "per_rank":
        parent.value = value
    elif isinstance(parent, (dict, list)):
        parent[leaf.key] = value
    else:
        raise UnsupportedValueError(
            f"variable {leaf.name!r} sits in a {type(parent).__name__}, which cannot be updated "
            "in place; use a list or dict"
        )


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
    store = resolve(root)
    workers = transfer_workers.resolve(io_workers, network=is_remote(store))
    read = ReadTarget(name, entry, target, out=out)
    return read_targets(store, [read], workers=workers, on_bytes=on_bytes)

"""Matching a state to a checkpoint's index, before anything is read.

Every rank matches its leaves to the stored variables by name and checks kind, dtype and
shape (:func:`prepare`); one collective (:func:`agree_names`) then makes the names that no
rank restores the job's, so ranks may hold different variables (pipeline stages). The
persistent load, the node-local tier's restore and the Hugging Face loader share these
rules.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distckpt import dtypes
from distckpt.comm import Communicator
from distckpt.errors import (
    MissingVariablesError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from distckpt.format.backed import check_stored
from distckpt.format.index import pieces_of
from distckpt.format.stored import Pieces
from distckpt.items import Leaf, flatten
from distckpt.pipeline.options import CheckpointOptions
from distckpt.pipeline.results import LoadResult
from distckpt.slices import Box
from distckpt.storage.backend import Store
from distckpt.transfer.reader import ReadTarget
from distckpt.values import decode

log = logging.getLogger("distckpt")


@dataclass
class Prepared:
    """A rank's reads, checked before anything is read, and where they go."""

    reads: list[ReadTarget]
    replicated: list[bool]  # per read: a plain tensor's (the same on every rank)
    fresh: list[tuple[Leaf, Any]]  # tensors and values to put in place once all is read


def prepare(
    state: dict[str, Any],
    index: dict[str, Any],
    result: LoadResult,
    rank: int,
    world: int,
    options: CheckpointOptions,
    *,
    located: bool = True,
    store: Store | None = None,
) -> Prepared | None:
    """Match the state's leaves to the index and check every one; restore the values.
    ``located=False``: the index describes the variables but not where their pieces are
    (the node-local tier's), so no :class:`~distckpt.format.stored.Pieces` are made.
    ``store``: the checkpoint's, where a tensor the checkpoint sizes (a ``None``
    placeholder) is found to be stored before it is allocated
    (:func:`~distckpt.format.backed.check_stored`; without it, by the index's word).

    ``options.strict`` and ``options.allow_pickle`` apply.

    Sets ``result.missing`` and this rank's ``result.unexpected`` (for :func:`agree_names`,
    which makes it the job's). None when ``strict`` and a name is missing: the load fails
    once the job has agreed on the names, so that the error lists the job's unexpected
    names too."""
    strict, allow_pickle = options.strict, options.allow_pickle
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
        pieces = pieces_of(index, entry, leaf.name) if stored_tensor else None
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
    prepared = Prepared([], [], [])
    for leaf, entry, pieces in jobs:
        box = target_box(leaf, entry)
        if box is None:  # decoded now (a refused pickle fails here), in place once all is read
            value = decode(entry["value"], allow_pickle=allow_pickle, name=leaf.name)
            prepared.fresh.append((leaf, value))
        elif leaf.tensor is None:  # a None placeholder or a per-rank value slot
            if pieces is not None and store is not None:  # the checkpoint says how large
                check_stored(store, pieces)
            elif pieces is not None:
                pieces.check_backed()
            tensor = torch.empty(box.lengths, dtype=dtypes.torch_dtype(entry["dtype"]))
            prepared.reads.append(ReadTarget(leaf.name, entry, box, tensor, stored=pieces))
            prepared.replicated.append(False)
            prepared.fresh.append((leaf, tensor))
        else:
            prepared.reads.append(ReadTarget(leaf.name, entry, box, leaf.tensor, stored=pieces))
            prepared.replicated.append(leaf.replicated)
        result.loaded.append(leaf.name)
    return prepared


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

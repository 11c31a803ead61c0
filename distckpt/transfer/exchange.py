"""One read per replicated byte: ranks restoring the same boxes share the reading.

Data-parallel replicas, plain (replicated) tensors and HSDP's replicate dimension make
several ranks restore the same boxes. Read naively, the shared store serves every byte
once per replica. Instead:

1. **Groups** (*allgather of two digests per rank): ranks whose replicated targets (plain
   tensors) are identical form one group, and ranks whose other targets are identical
   another (HSDP's replicas of one shard). A group of one reads alone.
2. **Split** (*one communicator split per kind of group, cached): each group gets its
   own communicator.
3. **Units**: each group's targets are cut into units (whole small targets; bands of rows
   of large ones, at the stored inner chunks' boundaries so no inner chunk is read
   twice, at most :data:`UNIT_BYTES`), and each unit is given to one member, balanced by
   bytes. Every member computes the same assignment.
4. **Read**: each rank reads its own units (with its unshared targets) from storage.
5. **Exchange** (*in each group: an allgather of each member's status, then one broadcast
   per unit or pack of small units): a unit is broadcast from its reader in place, straight
   into each member's target when that is a contiguous CPU tensor, else through a host
   buffer; small units of one reader travel together in packs of at most
   :data:`UNIT_BYTES`.

Bytes read from storage per load are then the checkpoint's, not the world's multiple of
it; :class:`~distckpt.engine.load.LoadResult` reports both the bytes read and the bytes
received from other ranks. A communicator without ``split`` and ``broadcast_array``
(:mod:`distckpt.comm.base`), or ``DISTCKPT_EXCHANGE=0``, makes every rank read what it
restores: on one host with a local file system the page cache already serves repeated
reads, and there the exchange (over gloo or MPI) can cost more than it saves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distckpt import dtypes, settings
from distckpt.comm import Communicator
from distckpt.slices import Box
from distckpt.transfer.arrays import copy_exact, writable_view
from distckpt.transfer.reader import ReadTarget

#: Largest unit, and largest pack of small units, in bytes.
UNIT_BYTES = 64 << 20
#: Targets smaller than this are never cut: one member reads each whole.
SPLIT_BYTES = 1 << 20

REPLICATED, OTHER = 0, 1


@dataclass
class Unit:
    """Rows ``rows`` (of dim 0, in the target's coordinates; whole for a 0-d target) of
    target ``target`` of a group, read by member ``owner``."""

    target: int
    rows: tuple[int, int]
    nbytes: int
    owner: int = 0


@dataclass
class Group:
    """The ranks restoring the same targets, their communicator and the units."""

    comm: Communicator
    targets: list[ReadTarget]
    units: list[Unit] = field(default_factory=list)

    @property
    def member(self) -> int:
        return self.comm.rank


def digest(targets: Sequence[ReadTarget]) -> bytes | None:
    """What identifies a list of targets between ranks (None for none)."""
    if not targets:
        return None
    h = hashlib.blake2b(digest_size=16)
    for t in targets:
        # The entry's path tells apart the per-rank entries of one name.
        key = (t.name, t.entry.get("path"), t.entry.get("dtype"), t.box.offsets, t.box.lengths)
        h.update(repr(key).encode())
    return h.digest()


def classes(reads: Sequence[ReadTarget], replicated: Sequence[bool]) -> list[list[ReadTarget]]:
    """The targets of plain (replicated) tensors, and the others, each in name order."""
    out: list[list[ReadTarget]] = [[], []]
    for t, rep in zip(reads, replicated, strict=True):
        if not t.box.empty:
            out[REPLICATED if rep else OTHER].append(t)
    for part in out:
        part.sort(key=lambda t: t.name)
    return out


def can_exchange(comm: Communicator) -> bool:
    """Whether ``comm`` has several ranks and can ``split`` and ``broadcast_array``."""
    return comm.size > 1 and hasattr(comm, "split") and hasattr(comm, "broadcast_array")


def wanted() -> bool:
    """This rank's ``$DISTCKPT_EXCHANGE`` (``0``: off); the ranks exchange only if all
    want to."""
    return settings.EXCHANGE.value()


def colors(everyone: Sequence[tuple[bytes | None, bytes | None]], kind: int) -> list[int]:
    """Each rank's group of one kind (-1: alone), from every rank's two digests."""
    counts: dict[bytes, int] = {}
    for pair in everyone:
        d = pair[kind]
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    ids: dict[bytes, int] = {}
    out = []
    for pair in everyone:
        d = pair[kind]
        if d is None or counts[d] < 2:
            out.append(-1)
        else:
            out.append(ids.setdefault(d, len(ids)))
    return out


def _quantum(t: ReadTarget) -> int:
    """Rows a band of ``t`` should be a multiple of (in global coordinates): the stored
    inner chunks' rows, so that no inner chunk is read by two members."""
    if t.stored is None or not t.box.ndim:
        return 1
    rows = {p.inner[0] if p.inner is not None else p.block[0] for p in t.stored.covering(t.box)}
    return rows.pop() if len(rows) == 1 else 1


def plan_units(targets: Sequence[ReadTarget], members: int) -> list[Unit]:
    """Every unit of a group's targets, each given to a member, balanced by bytes."""
    units: list[Unit] = []
    for i, t in enumerate(targets):
        itemsize = dtypes.itemsize(t.entry["dtype"])
        nbytes = t.box.numel * itemsize
        rows = t.box.lengths[0] if t.box.ndim else 1
        if nbytes < SPLIT_BYTES or rows == 1:
            units.append(Unit(i, (0, rows), nbytes))
            continue
        row_bytes = nbytes // rows
        bands = max(min(members, rows), -(-nbytes // UNIT_BYTES))
        q = _quantum(t)
        start0 = t.box.offsets[0]
        cuts = {0, rows}
        for k in range(1, bands):
            cut = start0 + rows * k // bands
            cut = min(max(start0, round(cut / q) * q), start0 + rows) - start0
            cuts.add(cut)
        edges = sorted(cuts)
        for lo, hi in zip(edges, edges[1:], strict=False):
            if hi > lo:
                units.append(Unit(i, (lo, hi), (hi - lo) * row_bytes))
    load = [0] * members
    for unit in sorted(units, key=lambda u: (-u.nbytes, u.target, u.rows)):
        unit.owner = min(range(members), key=lambda m: (load[m], m))
        load[unit.owner] += unit.nbytes
    return units


def unit_target(t: ReadTarget, unit: Unit) -> ReadTarget:
    """The read of one unit: a band of the target, into the same band of its tensor."""
    if not t.box.ndim:
        return t
    lo, hi = unit.rows
    box = Box((t.box.offsets[0] + lo, *t.box.offsets[1:]), (hi - lo, *t.box.lengths[1:]))
    tensor = None if t.tensor is None else t.tensor[lo:hi]
    out = None if t.out is None else t.out[lo:hi]
    return ReadTarget(t.name, t.entry, box, tensor, out, t.stored)


def _view(t: ReadTarget, unit: Unit) -> np.ndarray | None:
    """The unit's bytes in the target itself, when they can be broadcast in place."""
    region = _region(t, unit)
    if isinstance(region, torch.Tensor):
        return writable_view(region)
    return region if region.flags.c_contiguous else None


def _region(t: ReadTarget, unit: Unit) -> Any:
    whole: Any = t.out if t.out is not None else t.tensor
    return whole if not t.box.ndim else whole[unit.rows[0] : unit.rows[1]]


def _get(t: ReadTarget, unit: Unit, out: np.ndarray) -> None:
    """Copy the unit's bytes from the target into ``out`` (a host buffer)."""
    region = _region(t, unit)
    if isinstance(region, torch.Tensor):
        host = region.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        out[...] = host.numpy()
    else:
        out[...] = np.ascontiguousarray(region).reshape(-1).view(np.uint8)


def _put(t: ReadTarget, unit: Unit, data: np.ndarray) -> None:
    """Copy the unit's bytes from ``data`` (a host buffer) into the target."""
    region = _region(t, unit)
    if isinstance(region, torch.Tensor):
        values = torch.from_numpy(data).view(region.dtype).reshape(region.shape)
        copy_exact(region, values)
    else:
        region[...] = data.view(region.dtype).reshape(region.shape)


def exchange(group: Group) -> int:
    """Broadcast every unit from its reader to the group's other members; returns the
    bytes this rank received. Collective over ``group.comm``: every member makes the same
    broadcasts in the same order, decided by the units alone (a member whose target cannot
    take a broadcast in place goes through a buffer of its own)."""
    comm: Any = group.comm
    me = group.member
    received = 0
    packs: dict[int, list[Unit]] = {}
    for unit in group.units:
        if unit.nbytes < SPLIT_BYTES:
            packs.setdefault(unit.owner, []).append(unit)
            continue
        t = group.targets[unit.target]
        view = _view(t, unit)
        if view is not None:
            comm.broadcast_array(view.reshape(-1).view(np.uint8), root=unit.owner)
        else:
            buffer = np.empty(unit.nbytes, dtype=np.uint8)
            if unit.owner == me:
                _get(t, unit, buffer)
            comm.broadcast_array(buffer, root=unit.owner)
            if unit.owner != me:
                _put(t, unit, buffer)
        received += 0 if unit.owner == me else unit.nbytes
    for owner in sorted(packs):
        batch: list[Unit] = []
        size = 0
        for unit in packs[owner]:
            if batch and size + unit.nbytes > UNIT_BYTES:
                received += _pack(group, owner, batch)
                batch, size = [], 0
            batch.append(unit)
            size += aligned(unit.nbytes)
        received += _pack(group, owner, batch)
    return received


#: Each unit of a pack starts at a multiple of this (any dtype's alignment).
ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def _pack(group: Group, owner: int, batch: list[Unit]) -> int:
    """One broadcast of a pack of units read by ``owner``, each at an aligned offset."""
    comm: Any = group.comm
    offsets = np.cumsum([0, *(aligned(u.nbytes) for u in batch)]).tolist()
    buffer = np.empty(offsets[-1], dtype=np.uint8)
    if group.member == owner:
        for unit, lo in zip(batch, offsets, strict=False):
            _get(group.targets[unit.target], unit, buffer[lo : lo + unit.nbytes])
    comm.broadcast_array(buffer, root=owner)
    if group.member == owner:
        return 0
    for unit, lo in zip(batch, offsets, strict=False):
        _put(group.targets[unit.target], unit, buffer[lo : lo + unit.nbytes])
    return sum(u.nbytes for u in batch)

"""A rank's state as a save sees it: its leaves, where each tensor's bytes are read
from, its values encoded, its description for the plan, and the checksums of its
replicated tensors (which the coordinator compares across ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distckpt.items import Leaf
from distckpt.planning.describe import Desc
from distckpt.transfer.sources import Source
from distckpt.transfer.workers import TaskGroup, WorkerChoice


@dataclass
class LocalState:
    """This rank's leaves, where to read each tensor (by name), its encoded values, and
    the I/O workers it reads them with (chosen for where its tensors are)."""

    leaves: list[Leaf]
    sources: dict[str, Source]
    values: dict[str, Any]
    workers: WorkerChoice


@dataclass
class Described:
    """This rank's state and its descriptions, without checksums: what it offers for the
    plan."""

    local: LocalState
    descs: list[Desc]


def describe_state(local: LocalState) -> list[Desc]:
    """This rank's descriptions, without checksums (see :func:`_checksums`)."""
    descs: list[Desc] = []
    for leaf in local.leaves:
        if leaf.tensor is None:
            kind = "value" if leaf.kind == "value" else "per_rank"
            descs.append(Desc(leaf.name, kind, value=local.values[leaf.name]))
            continue
        descs.append(
            Desc(
                leaf.name,
                leaf.kind,
                dtype=leaf.dtype,
                shape=leaf.shape,
                box=leaf.box,
                replicated=leaf.replicated,
            )
        )
    return descs


def replica_checksums(local: LocalState, names: list[str]) -> dict[str, int]:
    """The crc32c of the replicated tensors ``names``, for the coordinator to check that
    every rank holds the same bytes; those in host memory are checksummed by the I/O
    workers, those staged through the slabs on this thread."""
    checksums: dict[str, int] = {}
    pending: dict[str, Any] = {}
    group = TaskGroup(local.workers.count)

    with group:
        for name in names:
            source = local.sources[name]
            if source.staged:
                checksums[name] = source.crc()
            else:
                pending[name] = group.submit(source.crc)
    checksums.update((name, future.result()) for name, future in pending.items())
    return checksums

"""The node-local tier on disk: one directory per node, one subdirectory per step.

::

    <node directory>/
      step-12/
        o3.<token>.data    rank 3's partitions of step 12, back to back, 64-byte aligned
        o3.<token>.json    their manifest: names, dtypes, global shapes, boxes, offsets,
                           sizes and crc32c, the Python values, the step, run and world
        done.<token>.r3    the mark of rank 3: written once every rank confirmed the step

``o<owner>`` files hold owner rank ``owner``'s partitions: its own, written by itself, or
a replica written by the peer that received them. Each save has a fresh ``token`` (chosen
by rank 0), so files of an older save of the same step number (a run that went back to
an older checkpoint) are never mistaken for the new one. A step's files on a node count
only when a ``done.<token>`` mark of the same token is there: a mark is written after the
one collective that confirmed that every rank's data and replicas were durable, so one
mark on a node vouches for every file of that token on it.

Nothing here is ever unpickled: manifests and marks are JSON, values are typed JSON
(:mod:`distckpt.values`), and every piece is checked against its crc32c before use.
Manifests and marks are sealed by their checksum (:mod:`distckpt.format.seal`, its
first member): a damaged manifest fails the restore of its step (the manager then falls
back to the shared directory), a damaged mark is ignored.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from distckpt.errors import CorruptCheckpointError
from distckpt.format import seal
from distckpt.numbering import number, numbered
from distckpt.storage.backend import Store

log = logging.getLogger("distckpt")

FORMAT = "distckpt-local"
VERSION = 1

#: The most ranks a local step may have been saved by (a mark's world size): far beyond
#: any job, and small enough that a count of ranks is never a hang.
MAX_WORLD = 1 << 24

_MARK = re.compile(r"^done\.([0-9a-f]+)\.r([0-9]+)$")
_MANIFEST = re.compile(r"^o([0-9]+)\.([0-9a-f]+)\.json$")


def step_dir(step: int) -> str:
    return f"step-{step}"


def step_of(name: str) -> int | None:
    """The step of a step directory's name ``step-N`` (:mod:`distckpt.numbering`)."""
    return numbered(name, "step-")


def data_name(owner: int, token: str) -> str:
    return f"o{owner}.{token}.data"


def data_key(step: int, owner: int, token: str) -> str:
    return f"{step_dir(step)}/{data_name(owner, token)}"


def manifest_key(step: int, owner: int, token: str) -> str:
    return f"{step_dir(step)}/o{owner}.{token}.json"


def mark_key(step: int, token: str, rank: int) -> str:
    return f"{step_dir(step)}/done.{token}.r{rank}"


@dataclass
class Held:
    """One committed save of a step on this node: whose partitions it holds."""

    step: int
    token: str
    world: int
    run: str
    owners: list[int] = field(default_factory=list)


def _read_mark(store: Store, key: str, step: int) -> tuple[int, str] | None:
    """The (world, run) a mark records, or None (logged) when it is not a mark of
    ``step``: a restart must get past a damaged tier, never fail on it."""
    try:
        raw = store.read(key)
        mark = json.loads(raw)
        if isinstance(mark, dict):
            seal.check(raw, store.where(key), mark)
        if not isinstance(mark, dict) or mark.get("format") != FORMAT:
            raise ValueError("not a distckpt local-tier mark")
        if mark.get("step") != step:
            raise ValueError(f"a mark of step {mark.get('step')}, not {step}")
        world, run = mark["world"], mark["run"]
        if type(world) is not int or not 1 <= world <= MAX_WORLD or not isinstance(run, str):
            raise ValueError(f"a world size of {world!r:.40} or a run of {run!r:.40}")
        return world, run
    except Exception as exc:
        log.warning("local tier: ignoring %s: %s", store.where(key), exc)
        return None


def survey(store: Store, run: str) -> list[Held]:
    """The committed saves of run ``run`` in the node directory ``store``, newest first
    (by step, then token), with the owners whose manifest and data are both there.
    Never raises: what cannot be read is skipped (and logged)."""
    found: list[Held] = []
    try:
        steps = store.list()
    except Exception:
        return []
    for name in steps:
        step = step_of(name)
        if step is None:
            continue
        try:
            entries = store.list(name)
        except Exception:
            continue
        present = set(entries)
        marks: dict[str, tuple[int, str] | None] = {}
        for entry in entries:
            m = _MARK.match(entry)
            if m is not None and marks.get(m.group(1)) is None:
                marks[m.group(1)] = _read_mark(store, f"{name}/{entry}", step)
        for token, mark in marks.items():
            if mark is None or mark[1] != run:
                continue
            owners = []
            for entry in entries:
                m = _MANIFEST.match(entry)
                if m is None or m.group(2) != token:
                    continue
                owner = number(m.group(1))
                if owner is None or data_name(owner, token) not in present:
                    continue
                if owner >= mark[0]:  # not a rank of the job that saved it
                    log.warning(
                        "local tier: ignoring %s: saved rank %d of a save by %d rank(s)",
                        store.where(f"{name}/{entry}"),
                        owner,
                        mark[0],
                    )
                    continue
                owners.append(owner)
            found.append(Held(step, token, mark[0], run, sorted(owners)))
    found.sort(key=lambda h: (h.step, h.token), reverse=True)
    return found


def read_manifest(
    store: Store, step: int, owner: int, token: str, run: str, world: int
) -> dict[str, Any]:
    """The manifest of ``owner``'s partitions of ``step``, checked to be one, and one of
    the save of ``token`` by ``world`` ranks of run ``run`` (as its mark says)."""
    key = manifest_key(step, owner, token)
    raw = store.read(key)
    where = store.where(key)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not a readable manifest: {exc}") from exc
    if isinstance(doc, dict) and seal.check(raw, where, doc):
        doc = seal.strip(doc)
    return manifest_of(doc, where, Held(step, token, world, run), owner)


def manifest_of(doc: Any, where: str, held: Held, owner: int) -> dict[str, Any]:
    """``doc``, checked to be the manifest of ``owner``'s partitions in the save ``held``
    (its step, token, run and world): read from a node directory, or received from the
    peer that saved it (``where`` names it in errors)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: not a distckpt local-tier manifest")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{where}: local-tier format version {doc.get('version')!r:.20} is not "
            f"{VERSION}; upgrade distckpt"
        )
    if doc.get("step") != held.step or doc.get("owner") != owner or doc.get("token") != held.token:
        raise CorruptCheckpointError(f"{where}: manifest of another save")
    if doc.get("run") != held.run or doc.get("world") != held.world:
        raise CorruptCheckpointError(
            f"{where}: manifest of run {doc.get('run')!r:.40} saved by "
            f"{doc.get('world')!r:.20} rank(s), not of run {held.run!r} saved by "
            f"{held.world} rank(s)"
        )
    return doc


def mark(store: Store, held: Held, rank: int) -> None:
    """Write rank ``rank``'s mark of the confirmed save ``held``, durably."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "step": held.step,
        "token": held.token,
        "world": held.world,
        "run": held.run,
    }
    store.write(mark_key(held.step, held.token, rank), seal.encode(doc))


def retain(store: Store, keep: int, run: str, below: int) -> list[int]:
    """Remove this node's steps older than its ``keep`` newest committed ones of ``run``
    below step ``below`` (the step just confirmed, kept as well), and the files of other
    saves in the kept steps; returns the steps removed. Logged, never raised.

    Counting only the steps below the new one keeps the previous whole step until the
    next save's confirmation: a node that removed it as soon as it marked the new step
    could leave no whole step at all if another node died before writing its mark."""
    try:
        held = [h for h in survey(store, run) if h.step < below]
        kept: dict[int, str] = {}
        for h in held:  # newest first: the token chosen is the one a restore would choose
            if len(kept) < keep or h.step in kept:
                kept.setdefault(h.step, h.token)
        if len(kept) < keep:
            return []
        oldest = min(kept)
        removed = []
        for name in store.list():
            step = step_of(name)
            if step is None:
                continue
            if step < oldest:
                store.delete_tree(name)
                removed.append(step)
            elif step in kept:
                for entry in store.list(name):
                    if kept[step] not in entry.split("."):
                        store.delete(f"{name}/{entry}")
        return removed
    except Exception as exc:
        log.warning("local tier: could not remove old steps of %s: %s", store.url, exc)
        return []


def drop_newer(store: Store, step: int) -> None:
    """Remove this node's steps newer than ``step``: they belong to a timeline the job
    left when it restored ``step`` (or an older checkpoint), or that a new save of a
    step number it had saved before replaces. Logged, never raised."""
    try:
        names = store.list()
    except Exception:
        return
    for name in names:
        found = step_of(name)
        if found is not None and found > step:
            try:
                store.delete_tree(name)
            except Exception as exc:
                log.warning("local tier: could not remove %s: %s", store.where(name), exc)

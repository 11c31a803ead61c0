"""The ``latest`` pointer of a run directory: which committed checkpoints it holds.

One small versioned JSON file, ``<dir>/latest``, written by rank 0 only, after the
checkpoint it names has been committed::

    {"checksum": "crc32c:1f0e2d3c", "format": "distckpt-pointer", "version": 1,
     "latest": "ckpt-3", "all": ["ckpt-1", "ckpt-2", "ckpt-3"]}

``checksum`` seals the file (:mod:`distckpt.format.seal`): a flipped byte that leaves
the JSON well-formed (another step in a name) is refused, not followed. A pointer
without it, of a distckpt that did not seal, is read as before.

Names are relative to the directory, so a run directory can be moved or copied. ``all``
lists the checkpoints the pointer knows, oldest first, ``latest`` last.

The pointer moves by a conditional write on the version its writer read (on an object
store ``If-Match`` on the ETag, ``If-None-Match`` for the first; on a file system a
compare under a ``lockf`` lock, then an atomic rename): a job that lost a race to another
one gets :class:`PointerConflictError` and the pointer is never moved backwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from distckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PointerConflictError,
    UnsupportedFormatError,
)
from distckpt.format import seal
from distckpt.format.index import is_committed
from distckpt.numbering import numbered
from distckpt.storage.backend import ConditionFailed, Store, check_name
from distckpt.storage.registry import child_location, open_store

POINTER_FILE = "latest"
FORMAT = "distckpt-pointer"
VERSION = 1


@dataclass
class Pointer:
    """The contents of a ``latest`` file: names relative to its directory."""

    latest: str
    all: list[str] = field(default_factory=list)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Pointer:
        """The pointer of a document validated by :func:`read_versioned`."""
        return cls(doc["latest"], [str(n) for n in doc.get("all", [])])

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, "latest": self.latest, "all": self.all}
        return dumps(doc)


def dumps(doc: dict[str, Any]) -> bytes:
    """The bytes of the pointer document ``doc`` (this class's or the manager's), sealed."""
    return seal.encode(doc, indent=1)


def read_versioned(directory: str | os.PathLike[str] | Store) -> tuple[dict[str, Any], str] | None:
    """The pointer document of ``directory`` (validated) and its version, or None."""
    store = open_store(directory)
    where = store.where(POINTER_FILE)
    try:
        raw, version = store.read_versioned(POINTER_FILE)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(f"{where} is not a distckpt pointer (bad JSON)") from None
    # The seal first: a damaged byte is named as such, not as whatever it became.
    if isinstance(doc, dict) and seal.check(raw, where, doc):
        doc = seal.strip(doc)
    try:
        kind, fmt_version = doc["format"], doc["version"]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where} is not a distckpt pointer (bad JSON)") from None
    if kind != FORMAT:
        raise CorruptCheckpointError(f"{where}: unknown pointer format {kind!r}")
    if not isinstance(fmt_version, int) or fmt_version > VERSION:
        raise UnsupportedFormatError(
            f"{where} has pointer version {fmt_version}; this distckpt reads up to {VERSION}"
        )
    latest, names = doc.get("latest"), doc.get("all", [])
    if not isinstance(latest, str) or not isinstance(names, list):
        raise CorruptCheckpointError(f"{where}: pointer has no 'latest' name")
    # A name leading out of the directory would make a restore read, and retention
    # delete, what is not the run's.
    for name in [latest, *names]:
        check_name(name, f"{where}: the checkpoint named")
    return doc, version


def read_pointer(directory: str | os.PathLike[str] | Store) -> Pointer | None:
    """The pointer of ``directory``, or None when it has none."""
    found = read_versioned(directory)
    if found is None:
        return None
    return Pointer.from_doc(found[0])


def move(directory: str | os.PathLike[str] | Store, doc: bytes, version: str | None) -> str:
    """Write the pointer ``doc`` if the pointer is still at ``version`` (None: if there is
    none); return the new version. Raises :class:`PointerConflictError` otherwise."""
    store = open_store(directory)
    try:
        if version is None:
            return store.put_new(POINTER_FILE, doc)
        return store.put_if(POINTER_FILE, doc, version)
    except ConditionFailed:
        raise PointerConflictError(
            f"{store.where(POINTER_FILE)} was changed by another job since this one read it; "
            "two jobs are saving into one directory (it was left as the other wrote it)"
        ) from None


def _older(name: str, than: str, listed: list[str]) -> bool:
    """Whether checkpoint ``name`` is older than ``than``: listed before it in the
    pointer's ``all``, or numbered lower under the same prefix (``ckpt-6``, ``ckpt-7``)."""
    if name in listed and than in listed:
        return listed.index(name) < listed.index(than)
    prefix, _, _ = name.rpartition("-")
    a, b = numbered(name, f"{prefix}-"), numbered(than, f"{prefix}-")
    return bool(prefix) and a is not None and b is not None and a < b


def advance_pointer(checkpoint: str | os.PathLike[str] | Store) -> Pointer:
    """Make the committed ``checkpoint`` its directory's latest (one rank only).

    Keeps the names of the pointer's earlier checkpoints that still exist, oldest first.
    Raises :class:`PointerConflictError`, leaving the pointer alone, when it names a newer
    checkpoint that exists (another job got further), so it never moves backwards.
    """
    store = open_store(checkpoint)
    directory, name = store.parent, store.name
    found = read_versioned(directory)
    old = None if found is None else Pointer.from_doc(found[0])
    kept = [] if old is None else [n for n in old.all if n != name and directory.is_dir(n)]
    if old is not None and _older(name, old.latest, old.all) and directory.is_dir(old.latest):
        raise PointerConflictError(
            f"{directory.where(POINTER_FILE)} names {old.latest!r}, newer than {name!r}: "
            "another job saves into this directory (the pointer was left as it was)"
        )
    pointer = Pointer(name, [*kept, name])
    move(directory, pointer.to_json(), None if found is None else found[1])
    return pointer


def latest_checkpoint(directory: str | os.PathLike[str] | Store) -> str | None:
    """The path of the newest checkpoint that ``directory``'s pointer names, or None.

    None when the directory or its pointer does not exist (nothing saved yet), so::

        status = ckpt.restore(distckpt.latest_checkpoint("run"))  # no-op on a fresh run

    A pointer naming a checkpoint that is not committed (deleted by hand) raises
    :class:`~distckpt.errors.CheckpointNotFoundError` rather than silently starting over.
    ``directory`` may be ``s3://bucket/prefix``; the result is then a URL too.
    """
    pointer = read_pointer(directory)
    if pointer is None:
        return None
    path = child_location(directory, pointer.latest)
    if not is_committed(path):
        raise CheckpointNotFoundError(
            f"{open_store(directory).where(POINTER_FILE)} names {pointer.latest!r}, which is not "
            "a committed checkpoint"
        )
    return path

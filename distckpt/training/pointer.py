"""The ``latest`` pointer of a run directory: which committed checkpoints it holds.

One small versioned JSON file, ``<dir>/latest``, replaced atomically (temp file, fsync,
rename, fsync of the directory) by rank 0 only, after the checkpoint it names has been
committed::

    {"format": "distckpt-pointer", "version": 1, "latest": "ckpt-3",
     "all": ["ckpt-1", "ckpt-2", "ckpt-3"]}

Names are relative to the directory, so a run directory can be moved or copied. ``all``
lists the checkpoints the pointer knows, oldest first, ``latest`` last.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from distckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from distckpt.storage import index as index_mod
from distckpt.storage.fsutil import atomic_write

POINTER_FILE = "latest"
FORMAT = "distckpt-pointer"
VERSION = 1


@dataclass
class Pointer:
    """The contents of a ``latest`` file: names relative to its directory."""

    latest: str
    all: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, "latest": self.latest, "all": self.all}
        return json.dumps(doc, indent=1).encode()


def pointer_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / POINTER_FILE


def read_pointer(directory: str | os.PathLike[str]) -> Pointer | None:
    """The pointer of ``directory``, or None when it has none."""
    path = pointer_path(directory)
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        doc = json.loads(raw)
        kind, version = doc["format"], doc["version"]
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{path} is not a distckpt pointer (bad JSON)") from None
    if kind != FORMAT:
        raise CorruptCheckpointError(f"{path}: unknown pointer format {kind!r}")
    if not isinstance(version, int) or version > VERSION:
        raise UnsupportedFormatError(
            f"{path} has pointer version {version}; this distckpt reads up to {VERSION}"
        )
    latest, names = doc.get("latest"), doc.get("all", [])
    if not isinstance(latest, str) or not isinstance(names, list):
        raise CorruptCheckpointError(f"{path}: pointer has no 'latest' name")
    return Pointer(latest, [str(n) for n in names])


def write_pointer(directory: str | os.PathLike[str], pointer: Pointer) -> None:
    """Replace ``directory``'s pointer atomically; call on one rank only, after the commit."""
    atomic_write(pointer_path(directory), pointer.to_json())


def advance_pointer(checkpoint: str | os.PathLike[str]) -> Pointer:
    """Make the committed ``checkpoint`` its directory's latest (one rank only).

    Keeps the names of the pointer's earlier checkpoints that still exist, oldest first.
    """
    path = Path(checkpoint)
    directory, name = path.parent, path.name
    old = read_pointer(directory)
    kept = [] if old is None else [n for n in old.all if n != name and (directory / n).is_dir()]
    pointer = Pointer(name, [*kept, name])
    write_pointer(directory, pointer)
    return pointer


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The path of the newest checkpoint that ``directory``'s pointer names, or None.

    None when the directory or its pointer does not exist (nothing saved yet), so::

        status = ckpt.restore(distckpt.latest_checkpoint("run"))  # no-op on a fresh run

    A pointer naming a checkpoint that is not committed (deleted by hand) raises
    :class:`~distckpt.errors.CheckpointNotFoundError` rather than silently starting over.
    """
    pointer = read_pointer(directory)
    if pointer is None:
        return None
    path = os.path.join(os.fspath(directory), pointer.latest)
    if not index_mod.is_committed(path):
        raise CheckpointNotFoundError(
            f"{pointer_path(directory)} names {pointer.latest!r}, which is not a committed "
            "checkpoint"
        )
    return path

"""``distckpt ls``: the checkpoints of a run directory.

Lists every committed checkpoint (a directory holding a distckpt index) and every
leftover of a save that did not commit (``.NAME.staging-TOKEN`` and ``.NAME.trash-TOKEN``
directories, see :mod:`distckpt.commit.staging`), with its number, creation time, bytes on
disk (the sum of its files' sizes), the world size that saved it, and which one the
``latest`` pointer names. Reads only indexes and directory listings, never tensor data.

A checkpoint's number is the one its name ends in (``ckpt-10``: 10), else the
``step`` or ``save_counter`` value its index holds. A :class:`~distckpt.CheckpointManager`
names its checkpoints by its save counter (1, 2, 3, ...), as TensorFlow's does, unless a
save is given ``checkpoint_number=`` (pass the training step there to number them by
step).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distckpt.commit.transaction import Pending, pending
from distckpt.errors import CheckpointError, CheckpointNotFoundError
from distckpt.format.index import is_committed, read_index
from distckpt.format.zarr_meta import ZARR_JSON
from distckpt.numbering import number
from distckpt.storage.backend import Store
from distckpt.storage.registry import location, open_store
from distckpt.training.pointer import read_pointer

_STEP = re.compile(r"(?:^|[-_.])([0-9]+)$")  # ckpt-10, step_10, 10
#: Index values that hold the number when a checkpoint's name does not end in one.
STEP_VARIABLES = ("step", "save_counter")

#: The state of a committed checkpoint.
COMMITTED = "committed"
#: The state of what a save that did not commit left (its staging or trash directory).
UNCOMMITTED = "uncommitted"
#: The state of a checkpoint whose index could not be read (its note says why).
UNREADABLE = "unreadable"


@dataclass
class Entry:
    """One row of ``distckpt ls``; ``created`` is a Unix time, ``None`` when unknown."""

    name: str
    state: str
    number: int | None = None
    created: float | None = None
    bytes: int = 0
    world_size: int | None = None
    latest: bool = False
    note: str = ""

    @property
    def step(self) -> int | None:
        """The old name of :attr:`number` (kept for one release)."""
        warnings.warn(
            "distckpt.tools.runs.Entry.step is now Entry.number (the old name goes in the "
            "next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.number

    def to_json(self) -> dict[str, Any]:
        found = asdict(self)
        found["step"] = self.number  # the name "number" had until 0.1 (kept for a release)
        return found


@dataclass
class Listing:
    """What :func:`list_run` finds: the run ``directory``, the name its ``latest`` pointer
    holds, the committed checkpoints then the leftovers of saves (``entries``), and a
    ``warning`` when the pointer could not be read."""

    directory: Path | str
    latest: str | None
    entries: list[Entry]
    warning: str = ""


def list_run(directory: str | os.PathLike[str] | Store) -> Listing:
    """The checkpoints and leftovers in ``directory``, committed ones ordered by step."""
    root = open_store(directory)
    if not root.is_dir(""):
        raise CheckpointNotFoundError(f"{root.url} is not a directory (or holds nothing)")
    if is_committed(root):
        raise CheckpointError(
            f"{root.url} is a checkpoint, not a run directory (see distckpt inspect)"
        )
    warning = ""
    try:
        pointer = read_pointer(root)
    except CheckpointError as exc:
        pointer, warning = None, f"ignoring the pointer: {exc}"
    latest = pointer.latest if pointer is not None else None
    entries: list[Entry] = []
    for name in root.list():
        # A link, a FIFO or a file is no checkpoint of this run: never followed, skipped.
        if name.startswith(".") or not root.is_dir(name):
            continue
        child = root.child(name)
        try:
            if not child.exists(ZARR_JSON):
                continue
        except OSError:  # swapped for a link since: the same
            continue
        entry = _committed(child, latest)
        if entry is not None:
            entries.append(entry)
    entries.sort(key=lambda e: (e.number is None, e.number or 0, e.name))
    entries.extend(_leftover(p) for p in pending(root))
    return Listing(location(root), latest, entries, warning)


def _committed(store: Store, latest: str | None) -> Entry | None:
    """The row of a checkpoint; None for a zarr group that is not a distckpt checkpoint."""
    try:
        index = read_index(store)
    except CheckpointNotFoundError:
        return None
    except CheckpointError as exc:
        index = None
        note = str(exc)
    name = store.name
    entry = Entry(name, COMMITTED, latest=name == latest, bytes=_disk_bytes(store))
    entry.number = _number_from_name(name)
    if index is None:
        entry.state, entry.note = UNREADABLE, note
        return entry
    created, world = index.get("created"), index.get("world_size")
    entry.created = float(created) if isinstance(created, (int, float)) else None
    entry.world_size = world if isinstance(world, int) else None
    if entry.number is None:
        entry.number = _number_from_index(index)
    return entry


def _leftover(save: Pending) -> Entry:
    entry = Entry(save.name, UNCOMMITTED, number=_number_from_name(save.target), bytes=save.bytes)
    if save.live:
        entry.note = f"a save of {save.target} in progress"
    else:
        entry.note = f"leftover of a save of {save.target} (distckpt gc removes it)"
    entry.created = save.started
    return entry


def _number_from_name(name: str) -> int | None:
    match = _STEP.search(name)
    return number(match[1]) if match else None


def _number_from_index(index: dict[str, Any]) -> int | None:
    for name in STEP_VARIABLES:
        entry = index["variables"].get(name)
        if isinstance(entry, dict) and entry.get("kind") == "value":
            value = entry.get("value")
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _disk_bytes(store: Store) -> int:
    return sum(size for _, size, _ in store.walk())

"""How a save becomes a checkpoint, on each kind of store: one interface, two strategies.

* On a file system (:attr:`Store.renames`): "write under a temporary name, then rename"
  (:mod:`distckpt.storage.staging`): the ranks write into a staging directory beside the
  final name, and the commit renames it into place.
* On an object store: "a claim, then the index last" (:mod:`distckpt.storage.claim`):
  the ranks write under the final prefix, and the index, created only if absent, is the
  commit.

Call order (the coordinator makes every call but :func:`save_root`)::

    txn = begin(final, token, world_size, overwrite=...)   # name checked, claimed
    # every rank writes its pieces under save_root(final, token)
    txn.commit(files, index)     # or txn.abort() after any failure
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Protocol

from distckpt.errors import CheckpointExists, UnsafePathError
from distckpt.storage import claim as claim_mod
from distckpt.storage import index as index_mod
from distckpt.storage import staging as staging_mod
from distckpt.storage.backend import Store, resolve
from distckpt.storage.claim import ObjectCommit, read_claim
from distckpt.storage.claim import collect_garbage as collect_objects
from distckpt.storage.claim import leftovers as object_leftovers
from distckpt.storage.fsutil import fsync_dir
from distckpt.storage.posix import PosixStore
from distckpt.storage.zarr_meta import ZARR_JSON

log = logging.getLogger(__name__)


class Transaction(Protocol):
    """One save's way to its commit (coordinator only)."""

    #: Where the ranks write (the staging directory, or the final prefix itself).
    root: Store

    def commit(self, files: dict[str, bytes], index: bytes) -> None:
        """Write ``files`` (key: bytes, the groups' metadata), then the index; the
        checkpoint exists from then on."""

    def abort(self) -> None:
        """Remove what the save wrote; never raises."""


def save_root(final: Store, token: str) -> Store:
    """Where the ranks of save ``token`` write its pieces."""
    if isinstance(final, PosixStore):
        return PosixStore(staging_mod.staging_path(final.path, token))
    return final


def begin(final: Store, token: str, world_size: int, *, overwrite: bool) -> Transaction:
    """Check that ``final`` may be written (it holds no committed checkpoint, or
    ``overwrite``; nothing that is not a checkpoint), clean up abandoned saves beside it,
    and start the save."""
    if isinstance(final, PosixStore):
        return PosixCommit(final, token, world_size, overwrite=overwrite)
    collect_objects(final.parent)
    return ObjectCommit(final, token, world_size, overwrite=overwrite)


class PosixCommit:
    """The staging directory of one save and its rename into place."""

    def __init__(self, final: PosixStore, token: str, world_size: int, *, overwrite: bool) -> None:
        path = final.path
        committed = index_mod.is_committed(final)
        if path.exists() and not committed and any(path.iterdir()):
            raise CheckpointExists(
                f"{path} exists and is not a distckpt checkpoint; not "
                + ("replacing it" if overwrite else "touching it")
            )
        if committed and not overwrite:
            raise CheckpointExists(
                f"{path} already holds a committed checkpoint; pass overwrite=True to replace it"
            )
        staging_mod.collect_garbage(path.parent)
        self.final = final
        self.overwrite = overwrite
        self._staging = staging_mod.Staging(path, token, world_size)
        self.root: Store = PosixStore(self._staging.path)

    def commit(self, files: dict[str, bytes], index: bytes) -> None:
        for key, data in files.items():
            self.root.write(key, data)
        self.root.persist(files)
        self.root.write(ZARR_JSON, index)
        if not self.overwrite and index_mod.is_committed(self.final):
            raise CheckpointExists(
                f"{self.final.url} was committed by another save while this one ran"
            )
        self._staging.commit(overwrite=self.overwrite)

    def abort(self) -> None:
        self._staging.abort()


def retire(checkpoint: Store) -> None:
    """Delete a committed checkpoint so that no reader ever sees half of it: on a file
    system mark it, rename it out of sight, then remove it; on an object store delete its
    index first, then its data (:func:`distckpt.storage.claim.retire`)."""
    if not isinstance(checkpoint, PosixStore):
        claim_mod.retire(checkpoint)
        return
    final = checkpoint.path
    if final.is_symlink():  # not a checkpoint of this directory: never delete through it
        raise UnsafePathError(f"{final} is a symbolic link, not a checkpoint; left alone")
    # The mark keeps collect_garbage from restoring it as an interrupted commit.
    checkpoint.write(staging_mod.OWNER_FILE, json.dumps({"deleting": True}).encode())
    trash = staging_mod.trash_path(final, uuid.uuid4().hex[:16])
    os.rename(final, trash)
    fsync_dir(final.parent)
    try:
        shutil.rmtree(trash)
    except OSError as exc:
        log.warning("could not remove %s (collect_garbage will): %s", trash, exc)


def retiring(checkpoint: Store) -> bool:
    """Whether ``checkpoint`` was being deleted by a retention that did not finish."""
    if isinstance(checkpoint, PosixStore):
        return checkpoint.exists(staging_mod.OWNER_FILE)
    return claim_mod.retiring(checkpoint)


def collect_garbage(directory: str | os.PathLike[str] | Store) -> list[str]:
    """Remove abandoned saves in ``directory`` (never a live one); return what went."""
    store = resolve(directory)
    if isinstance(store, PosixStore):
        return [str(p) for p in staging_mod.collect_garbage(store.path)]
    return collect_objects(store)


@dataclass
class Pending:
    """A save in ``directory`` that has not committed: running, or abandoned."""

    name: str  # the staging directory, or the checkpoint prefix holding the claim
    target: str  # the checkpoint name it saves
    live: bool  # its heartbeat is fresh
    started: float | None  # Unix time, when known
    bytes: int


def pending(directory: Store) -> list[Pending]:
    """The uncommitted saves in ``directory``, sorted by name."""
    found = []
    if isinstance(directory, PosixStore):
        for path in staging_mod.leftovers(directory.path):
            match = staging_mod.LEFTOVER.match(path.name)
            target = match["name"] if match else path.name
            live = ".staging-" in path.name and staging_mod.owner_alive(path)
            store = PosixStore(path)
            try:  # when the save started, else when the directory last changed
                started: float | None = float(
                    json.loads(store.read(staging_mod.OWNER_FILE))["started"]
                )
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                try:
                    started = path.stat().st_mtime
                except OSError:
                    started = None
            found.append(Pending(path.name, target, live, started, _bytes(store)))
        return found
    for name in object_leftovers(directory):
        prefix = directory.child(name)
        claim = read_claim(prefix)
        if claim is None or prefix.exists(ZARR_JSON):
            continue  # committed meanwhile, or a commit's claim not yet released
        owner = claim[0]
        started = owner.get("time")
        found.append(
            Pending(
                name,
                name,
                claim_mod.live(claim),
                float(started) if isinstance(started, (int, float)) else None,
                _bytes(prefix),
            )
        )
    return found


def _bytes(store: Store) -> int:
    return sum(size for _, size, _ in store.walk())


def leftovers(directory: str | os.PathLike[str] | Store) -> list[str]:
    """Saves in ``directory`` that are running or were abandoned."""
    store = resolve(directory)
    if isinstance(store, PosixStore):
        return [str(p) for p in staging_mod.leftovers(store.path)]
    return [store.where(name) for name in object_leftovers(store)]

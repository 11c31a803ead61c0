"""The commit by rename (:data:`RENAME`): "write under a temporary name, then rename".

A save of ``<name>`` writes into ``.<name>.staging-<token>/`` beside it, never into
``<name>``. The coordinator creates it with an owner file (host, pid, start time) whose
modification time is a heartbeat, refreshed by a daemon thread while the save runs (the
file is sealed by its checksum, :mod:`distckpt.format.seal`: a damaged one names no
process, and its heartbeat alone decides whether the save is alive). The
commit writes the index, makes it durable, puts a commit file (the owner's host and pid)
in the owner file's place, renames the directory to ``<name>`` (atomically exchanging it
with an existing checkpoint when replacing one), makes the parent's entries durable and
removes the commit file. A checkpoint therefore exists under its name only once it is
complete.

Retention (:meth:`RenameStrategy.retire`) marks a checkpoint with an owner file that says
so, renames it out of sight (``.<name>.trash-<token>``), then removes it.
:meth:`RenameStrategy.collect_garbage` removes staging directories whose heartbeat has
stopped (or whose owner process is gone on this host) and trash directories; it never
touches a staging directory whose heartbeat is fresh, and puts back a complete checkpoint
that a replacing commit left under its staging name. A staging directory without an
owner file that holds no index belongs to no running save (the owner file goes only
after the index is written) and is removed too: what a rank of an aborted save wrote
after the coordinator removed the directory, or a removal cut short. One that holds an
index is a commit under way while its commit file names a live process (on this host;
elsewhere, for a minute); a commit killed before its rename is removed at once (the name
keeps the checkpoint it held), and one killed inside a replacing commit, the name
already gone, is put back. An abort renames
the directory to a trash name before removing it, so a kill in the middle of the
removal leaves a trash directory, which the next save removes.

Everything here goes through the store's methods: :class:`~distckpt.storage.backend.Store`
and the three of :class:`~distckpt.storage.backend.RenamingStore` (``rename``,
``exchange``, ``touch``), so any store that declares ``renames`` can use it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distckpt.commit.lease import pid_dead
from distckpt.commit.strategy import Pending
from distckpt.errors import CheckpointExists, StorageError, UnsafePathError
from distckpt.format import seal
from distckpt.format.index import is_committed
from distckpt.format.zarr_meta import ZARR_JSON
from distckpt.storage.backend import RenamingStore, Store, is_name, write_whole
from distckpt.storage.registry import location, open_store

log = logging.getLogger(__name__)

OWNER_FILE = ".distckpt-owner.json"
#: The owner file's successor during the rename: who commits (removed once committed).
COMMIT_FILE = ".distckpt-commit.json"
HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 60.0
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<what>staging|trash)-(?P<token>[0-9a-f]+)$")
#: What a staging or trash directory's name looks like, whether or not it parses.
_LOOKS_LEFTOVER = re.compile(r"^\..*\.(?:staging|trash)-")


def staging_name(name: str, token: str) -> str:
    return f".{name}.staging-{token}"


def trash_name(name: str, token: str) -> str:
    return f".{name}.trash-{token}"


def renaming(store: Store) -> RenamingStore:
    """``store``, which the rename commit needs to have :class:`RenamingStore`'s methods."""
    if not isinstance(store, RenamingStore):
        raise StorageError(
            f"{store.url}: the rename commit needs the store's rename, exchange and touch "
            "methods (distckpt.storage.backend.RenamingStore)"
        )
    return store


class Staging:
    """A staging directory owned by this process (the coordinator), with its heartbeat."""

    def __init__(self, final: str | os.PathLike[str] | Store, token: str, world_size: int) -> None:
        self.final = open_store(final)
        self.token = token
        self.parent = renaming(self.final.parent)
        self.entry = staging_name(self.final.name, token)
        self.store = renaming(self.parent.child(self.entry))
        self.path = location(self.store)
        self.store.prepare([OWNER_FILE])  # the directory, and the parent if need be
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "world_size": world_size,
            "target": self.final.name,
        }
        self.owner = owner
        try:  # not durable: the commit removes it; a crash leaves a stale one
            write_whole(self.store, OWNER_FILE, [seal.encode(owner)], durable=False)
        except BaseException:
            self.parent.delete_tree(self.entry)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="distckpt-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                self.store.touch(OWNER_FILE)
            except Exception:
                return

    def stop_heartbeat(self) -> None:
        self._stop.set()
        self._thread.join()

    def check_mine(self) -> None:
        """Raise :class:`StorageError` unless the staging directory is still the one this
        save made (its owner file as written): one that another process moved away, whose
        name the save's later writes made again, holds only what was written since."""
        try:
            found: dict[str, Any] | None = read_owner(self.store)
        except OSError:
            found = None
        if found != self.owner:
            raise StorageError(
                errno.ENOENT,
                f"{self.path}: the staging directory of this save was moved or replaced by "
                "another process; not committed",
            )

    def commit(self, *, overwrite: bool) -> None:
        """Rename the finished staging directory to its final name (coordinator only).

        The caller has written and made durable every file, including the index.
        """
        self.stop_heartbeat()
        # Who commits stays known until the rename: a kill in between leaves a staging
        # directory that the next save knows to be dead (its process is gone).
        write_whole(self.store, COMMIT_FILE, [seal.encode(self.owner)], durable=False)
        self.store.delete(OWNER_FILE)
        self.store.persist([OWNER_FILE])
        parent, mine, name = self.parent, self.entry, self.final.name
        if overwrite and parent.exists(name):
            self._replace()
            return
        # A rename onto a directory that holds entries fails: no silent overwrite.
        try:
            parent.rename(mine, name)
        except OSError as exc:
            # Another save committed the name between the check and the rename; anything
            # else there is not ours to replace.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_committed(self.final):
                raise
            taken = exc
        else:
            self._placed()
            parent.persist([name])
            _drop_commit_file(parent.child(name))
            return
        if not overwrite:
            raise CheckpointExists(
                f"{self.final.url} was committed by another save while this one ran"
            ) from taken
        self._replace()

    def _replace(self) -> None:
        """Put the staging directory in the place of the checkpoint its name holds."""
        parent, mine, name = self.parent, self.entry, self.final.name
        if parent.exchange(mine, name):
            self._placed()
            parent.persist([name])
            _drop_commit_file(parent.child(name))
            parent.delete_tree(mine)  # now holds the old checkpoint
            return
        trash = trash_name(name, self.token)
        parent.rename(name, trash)
        parent.rename(mine, name)
        self._placed()
        parent.persist([name])
        _drop_commit_file(parent.child(name))
        parent.delete_tree(trash)

    def _placed(self) -> None:
        """After the rename: the name holds a directory. A racing process that swapped
        the staging directory for a link had the link renamed into place; the save then
        fails rather than report a checkpoint that is not there."""
        if not self.parent.is_dir(self.final.name):
            raise UnsafePathError(
                f"{self.final.url}: its staging directory {self.parent.where(self.entry)} "
                "was replaced (by a link?) during the commit; not committed"
            )

    def abort(self) -> None:
        self.stop_heartbeat()
        # Out of sight first: a removal cut short (the job's teardown kills this process)
        # leaves a trash directory, which any later save removes.
        trash = trash_name(self.final.name, self.token)
        try:
            self.parent.rename(self.entry, trash)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("removing %s in place: %s", self.path, exc)
            trash = self.entry
        self.parent.delete_tree(trash)


class RenameCommit:
    """The staging directory of one save and its rename into place (coordinator only)."""

    def __init__(self, final: Store, token: str, world_size: int, *, overwrite: bool) -> None:
        parent = final.parent
        committed = is_committed(final)
        if not committed and parent.exists(final.name) and (not final.is_dir("") or final.list()):
            raise CheckpointExists(
                f"{final.url} exists and is not a distckpt checkpoint; not "
                + ("replacing it" if overwrite else "touching it")
            )
        if committed and not overwrite:
            raise CheckpointExists(
                f"{final.url} already holds a committed checkpoint; pass overwrite=True to "
                "replace it"
            )
        collect(parent)
        self.final = final
        self.overwrite = overwrite
        self._staging = Staging(final, token, world_size)
        self.root: Store = self._staging.store

    def commit(self, files: dict[str, bytes], index: bytes) -> None:
        self._staging.check_mine()
        for key, data in files.items():
            self.root.write(key, data)
        self.root.persist(files)
        self.root.write(ZARR_JSON, index)
        if not self.overwrite and is_committed(self.final):
            raise CheckpointExists(
                f"{self.final.url} was committed by another save while this one ran"
            )
        self._staging.commit(overwrite=self.overwrite)

    def abort(self) -> None:
        self._staging.abort()


def _drop_commit_file(checkpoint: Store) -> None:
    """Remove the commit file a rename carried into ``checkpoint`` (not durably: one that
    comes back after a crash names a process that is gone, and nothing reads it in a
    checkpoint)."""
    try:
        checkpoint.delete(COMMIT_FILE)
    except OSError as exc:
        log.warning("could not remove %s: %s", checkpoint.where(COMMIT_FILE), exc)


def read_owner(staging: Store) -> dict[str, Any]:
    """The owner file of ``staging`` ({} when it is damaged: its seal fails, or it is not
    a JSON object). Raises OSError when there is none."""
    return seal.load_or_unknown(staging.read(OWNER_FILE), staging.where(OWNER_FILE), "owner")


def owner_alive(staging: Store, stale_seconds: float = STALE_SECONDS) -> bool:
    """Whether the save that owns the staging directory ``staging`` still runs (its
    heartbeat is fresh and, on this host, its process exists). A damaged owner file
    names no process: the heartbeat alone decides, so a flipped pid never makes a live
    save look dead."""
    try:
        age = staging.age(OWNER_FILE)
        info = read_owner(staging)
    except OSError:
        return _unowned_alive(staging, stale_seconds)
    return age <= stale_seconds and not pid_dead(info)


def _unowned_alive(staging: Store, stale_seconds: float) -> bool:
    """Whether a staging directory without an owner file may belong to a running save.

    A save removes its owner file only after writing the index, just before the rename: a
    directory with an index is a commit under way (or interrupted), judged by its age.
    One without an index belongs to no running save, except in the instant between the
    coordinator making it and writing the owner file, when it is empty (or holds the owner
    file by the time it is listed: the save began between the two looks). Anything else is
    what a dead save left: files a rank wrote after its coordinator removed the
    directory (recreating it), or a removal cut short."""
    try:
        age = staging.parent.age(staging.name)
    except OSError:
        return False
    if is_committed(staging):
        return _committing(staging, age, stale_seconds)
    try:
        entries = staging.list()
    except OSError:
        return False
    if OWNER_FILE in entries:  # written since it was looked for: a save that just began
        return True
    return not entries and age < HEARTBEAT_SECONDS


def _committing(staging: Store, age: float, stale_seconds: float) -> bool:
    """Whether the complete staging directory ``staging`` (an index, no owner file) may
    be a commit under way: its commit file names a live process (on another host: it is
    younger than ``stale_seconds``). Without one (a version of distckpt before the commit
    file, or an old checkpoint a replacing commit exchanged out), its age decides."""
    try:
        commit_age = staging.age(COMMIT_FILE)
        info = seal.load_or_unknown(staging.read(COMMIT_FILE), staging.where(COMMIT_FILE), "commit")
    except OSError:
        return age < stale_seconds
    return commit_age <= stale_seconds and not pid_dead(info)


def _complete(staging: Store) -> bool:
    return not staging.exists(OWNER_FILE) and is_committed(staging)


def parse_leftover(entry: str) -> re.Match[str] | None:
    """The parts of a staging or trash directory's name (``name``, ``what``, ``token``),
    or None when it does not parse, or names no checkpoint (``...trash-0`` would be a
    trash of ``.``)."""
    match = LEFTOVER.match(entry)
    return match if match is not None and is_name(match["name"]) else None


def leftover_names(directory: Store) -> list[str]:
    """The staging and trash directories in ``directory`` (live or not), by name. A link
    or a file with such a name is not one, nor is an entry whose name does not parse:
    they are left alone (:func:`skipped_names`)."""
    return [n for n in directory.list() if parse_leftover(n) and directory.is_dir(n)]


def skipped_names(directory: Store) -> list[tuple[str, str]]:
    """The entries of ``directory`` named like staging or trash directories that are not
    one, and why: what :func:`collect` leaves alone."""
    found = []
    for entry in directory.list():
        if not _LOOKS_LEFTOVER.match(entry):
            continue
        if parse_leftover(entry) is None:
            found.append(
                (entry, "its name does not parse as .NAME.staging-TOKEN or .NAME.trash-TOKEN")
            )
        elif not directory.is_dir(entry):
            found.append((entry, "not a directory (a link or a file)"))
    return found


def collect(directory: Store, stale_seconds: float = STALE_SECONDS) -> list[str]:
    """Remove the abandoned staging and trash directories in ``directory``; return the
    names of those removed."""
    parent = renaming(directory)
    removed: list[str] = []
    for entry in leftover_names(directory):
        try:
            if _collect_one(directory, parent, entry, stale_seconds):
                removed.append(entry)
        except UnsafePathError as exc:  # swapped for a link since it was listed: not one
            log.warning("leaving %s alone: %s", directory.where(entry), exc)
    return removed


def _collect_one(directory: Store, parent: RenamingStore, entry: str, stale_seconds: float) -> bool:
    """Remove the leftover ``entry`` of ``directory`` if it is abandoned (or put back the
    complete checkpoint it holds); whether it was removed."""
    match = parse_leftover(entry)
    assert match is not None
    staging = directory.child(entry)
    if match["what"] == "staging" and owner_alive(staging, stale_seconds):
        return False
    name = match["name"]
    if not directory.exists(name) and _complete(staging):
        # A crash inside a replacing commit: put the complete checkpoint back.
        log.warning("restoring %s from interrupted commit %s", directory.where(name), entry)
        parent.rename(entry, name)
        parent.persist([name])
        _drop_commit_file(directory.child(name))
        return False
    log.info("removing abandoned %s directory %s", match["what"], directory.where(entry))
    directory.delete_tree(entry)
    return True


def collect_garbage(
    directory: str | os.PathLike[str] | Store, stale_seconds: float = STALE_SECONDS
) -> list[Path | str]:
    """Remove abandoned staging and trash directories in ``directory``; return what went
    (paths on a file system)."""
    store = open_store(directory)
    return [location(store.child(name)) for name in collect(store, stale_seconds)]


def leftovers(directory: str | os.PathLike[str] | Store) -> list[Path | str]:
    """Staging and trash directories present in ``directory`` (live or not; paths on a
    file system)."""
    store = open_store(directory)
    return [location(store.child(name)) for name in leftover_names(store)]


class RenameStrategy:
    """The commit strategy of stores whose directories rename atomically (see the module)."""

    name = "rename"
    requires: tuple[str, ...] = ("renames",)

    def __repr__(self) -> str:
        return "RENAME"

    def save_root(self, final: Store, token: str) -> Store:
        return final.parent.child(staging_name(final.name, token))

    def begin(self, final: Store, token: str, world_size: int, *, overwrite: bool) -> RenameCommit:
        return RenameCommit(final, token, world_size, overwrite=overwrite)

    def retire(self, checkpoint: Store) -> None:
        """Mark ``checkpoint``, rename it out of sight, then remove it."""
        self.withdraw(checkpoint)()

    def withdraw(self, checkpoint: Store) -> Callable[[], None]:
        """Mark ``checkpoint`` and rename it out of sight; return the removal of what is
        left (a trash directory, which any later save removes if that never runs)."""
        parent, name = renaming(checkpoint.parent), checkpoint.name
        if not parent.is_dir(name):
            if parent.exists(name):  # not a checkpoint of this directory: never through it
                raise UnsafePathError(
                    f"{checkpoint.url} is not a directory (a link?), not a checkpoint; left alone"
                )
            return lambda: None
        # The mark keeps collect_garbage from restoring it as an interrupted commit. It is
        # written below the parent, where the name is never followed if it became a link.
        parent.child(name).write(OWNER_FILE, seal.encode({"deleting": True}))
        trash = trash_name(name, uuid.uuid4().hex[:16])
        parent.rename(name, trash)
        parent.persist([name])

        def remove() -> None:
            try:
                parent.delete_tree(trash)
            except OSError as exc:
                log.warning(
                    "could not remove %s (collect_garbage will): %s", parent.where(trash), exc
                )

        return remove

    def retiring(self, checkpoint: Store) -> bool:
        return checkpoint.exists(OWNER_FILE)

    def collect_garbage(self, directory: Store) -> list[str]:
        return [directory.where(name) for name in collect(directory)]

    def pending(self, directory: Store) -> list[Pending]:
        found = []
        for entry in leftover_names(directory):
            match = parse_leftover(entry)
            target = match["name"] if match else entry
            staging = directory.child(entry)
            live = ".staging-" in entry and owner_alive(staging)
            try:  # when the save started, else when the directory last changed
                started: float | None = float(read_owner(staging)["started"])
            except (OSError, ValueError, KeyError, TypeError):
                try:
                    started = time.time() - directory.age(entry)
                except OSError:
                    started = None
            size = sum(n for _, n, _ in staging.walk())
            found.append(Pending(entry, target, live, started, size))
        return found

    def leftovers(self, directory: Store) -> list[str]:
        return [directory.where(name) for name in leftover_names(directory)]

    def skipped(self, directory: Store) -> list[tuple[str, str]]:
        return [(directory.where(name), why) for name, why in skipped_names(directory)]


#: The commit by rename (see the module): ``commit_strategy = RENAME``.
RENAME = RenameStrategy()

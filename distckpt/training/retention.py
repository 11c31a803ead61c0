"""Which checkpoints a :class:`~distckpt.CheckpointManager` keeps, and the pointer that
lists them.

**State.** Everything lives in the run directory's ``latest`` pointer (see
:mod:`distckpt.training.pointer`), so a new manager on the same directory (a restarted
job) sees the same list. Next to ``latest`` and ``all`` the pointer carries a
``"manager"`` entry: the commit time of every checkpoint, the checkpoints preserved by
``keep_checkpoint_every_n_hours`` and the time of the last one preserved. A committed
``<name>-N`` that the pointer does not name (a crash between the commit and the pointer
update) is adopted by :meth:`Retention.recover`.

**Retention.** Only after the new checkpoint is committed *and* the pointer names the
new list does rank 0 delete what fell out of it (:meth:`Retention.delete`, through
:func:`~distckpt.commit.transaction.retire`: marked, renamed out of sight or withdrawn
index first, then removed). A crash leaves at worst a leftover that the next save's
garbage collection removes; a checkpoint marked for deletion is never adopted. With
``delete_in_background`` the save only withdraws (:meth:`Retention.withdraw`: marked and
out of sight) and :class:`Deletions` runs the rest on a thread of rank 0.

Rank 0 reads and writes the pointer and deletes; every rank holds the same list (set
from what rank 0 broadcast).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from distckpt import settings
from distckpt.commit.transaction import retiring, withdraw
from distckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from distckpt.format.index import read_index
from distckpt.numbering import numbered
from distckpt.storage.backend import Store
from distckpt.storage.registry import child_location
from distckpt.training.pointer import (
    FORMAT,
    POINTER_FILE,
    VERSION,
    Pointer,
    move,
    read_versioned,
)
from distckpt.training.pointer import dumps as pointer_dumps

log = logging.getLogger("distckpt.training.manager")


def created(path: Store) -> float | None:
    """When the checkpoint at ``path`` was committed (0.0 when its index does not say, or
    is of a newer format), or None when ``path`` holds no committed checkpoint: one read
    of its index tells both."""
    try:
        index = read_index(path)
    except UnsupportedFormatError:
        return 0.0
    except CheckpointNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        log.warning("%s is unreadable, so not restored (left in place): %s", path.url, exc)
        return None
    when = index.get("created")
    return float(when) if isinstance(when, (int, float)) else 0.0


def manager_entry(meta: Any, where: str) -> dict[str, Any]:
    """The pointer's ``"manager"`` entry, checked: commit times by name (numbers), the
    preserved names and the time of the last one preserved."""
    if meta is None:
        return {}
    times = meta.get("times") if isinstance(meta, dict) else None
    preserved = meta.get("preserved") if isinstance(meta, dict) else None
    last = meta.get("last_preserved") if isinstance(meta, dict) else None
    number = (int, float)
    if (
        not isinstance(meta, dict)
        or not isinstance(times or {}, dict)
        or not all(
            isinstance(v, number) and not isinstance(v, bool) for v in (times or {}).values()
        )
        or not isinstance(preserved or [], list)
        or not all(isinstance(n, str) for n in preserved or [])
        or (last is not None and (not isinstance(last, number) or isinstance(last, bool)))
    ):
        raise CorruptCheckpointError(f"{where}: the manager's entry is malformed")
    return meta


class Retention:
    """The checkpoints ``<name>-N`` of ``directory`` a manager keeps: the newest
    ``max_to_keep`` (None: all) and, with ``keep_hours``, one per that many hours of
    commit time among those that fall out, forever."""

    def __init__(
        self,
        store: Store,
        directory: str,
        name: str,
        max_to_keep: int | None,
        keep_hours: float | None,
        clock: Callable[[], float],
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad checkpoint_name {name!r}")
        self.store = store
        self.directory = directory
        self.name = name
        self.max_to_keep = max_to_keep
        self.keep_hours = keep_hours
        self.clock = clock
        self.pointer_version: str | None = None  # rank 0: the pointer as last read or written
        self.set_state({"managed": [], "preserved": [], "times": {}, "last_preserved": 0.0})

    # ------------------------------------------------------------ the list

    def set_state(self, state: dict[str, Any]) -> None:
        """Take the list as rank 0 decided it (every rank)."""
        self.managed: list[str] = list(state["managed"])
        self.preserved: list[str] = list(state["preserved"])
        self.times: dict[str, float] = dict(state["times"])
        self.last_preserved: float = float(state["last_preserved"])

    def path(self, name: str) -> str:
        """The path (or URL) of checkpoint ``name`` of this directory."""
        return child_location(self.directory, name)

    def number(self, path: str) -> int:
        """The ``N`` of the checkpoint at ``path`` (0 if its name is not ``<name>-N``)."""
        found = self.numbered(os.path.basename(path.rstrip("/")))
        return 0 if found is None else found

    def numbered(self, name: str) -> int | None:
        """N of a name ``<name>-N`` (:mod:`distckpt.numbering`), else None."""
        return numbered(name, f"{self.name}-")

    def latest(self) -> str | None:
        names = self.managed or self.preserved
        return self.path(names[-1]) if names else None

    def free_name(self, number: int) -> tuple[str, int]:
        """Rank 0: ``<name>-<number>``, or the next number whose name is free (never one
        the list names or the directory holds)."""
        taken = {*self.managed, *self.preserved}
        first = number
        while f"{self.name}-{number}" in taken or self._occupied(f"{self.name}-{number}"):
            number += 1
        if number != first:
            log.warning(
                "%s-%d exists; saving as %s-%d instead", self.name, first, self.name, number
            )
        return f"{self.name}-{number}", number

    def _occupied(self, name: str) -> bool:
        return self.store.is_dir(name) or self.store.exists(name)

    def retain(self, name: str, now: float) -> tuple[dict[str, Any], list[str]]:
        """Rank 0: the new list with ``name`` (committed at ``now``) added, and the names
        that fall out of it."""
        managed = [*self.managed, name]
        preserved = list(self.preserved)
        times = {**self.times, name: now}
        last_preserved = self.last_preserved
        doomed: list[str] = []
        if self.max_to_keep is not None:
            while len(managed) > self.max_to_keep:
                old = managed.pop(0)
                if (
                    self.keep_hours is not None
                    and times[old] - last_preserved >= self.keep_hours * 3600.0
                ):
                    preserved.append(old)
                    last_preserved = times[old]
                else:
                    doomed.append(old)
                    times.pop(old, None)
        state = {
            "managed": managed,
            "preserved": preserved,
            "times": times,
            "last_preserved": last_preserved,
        }
        return state, doomed

    # ------------------------------------------------------------ storage (rank 0)

    def recover(self) -> dict[str, Any]:
        """Rank 0: the list as the pointer names it, without what is gone or being
        deleted, with committed checkpoints it does not name adopted; the pointer is
        rewritten when that changed anything."""
        directory = self.store
        found = read_versioned(directory)  # validates format and version
        meta: dict[str, Any] = {}
        pointer = None
        if found is not None:
            raw, self.pointer_version = found
            pointer = Pointer.from_doc(raw)
            meta = manager_entry(raw.get("manager"), directory.where(POINTER_FILE))
        times = {str(k): float(v) for k, v in (meta.get("times") or {}).items()}
        preserved_set = {str(n) for n in meta.get("preserved") or []}

        when_created: dict[str, float] = {}

        def alive(name: str) -> bool:
            path = directory.child(name)
            when = created(path)
            if when is None or retiring(path):
                return False
            when_created[name] = when
            return True

        known = [] if pointer is None else [n for n in pointer.all if alive(n)]
        if pointer is not None and pointer.latest not in pointer.all and alive(pointer.latest):
            known.append(pointer.latest)
        preserved = [n for n in known if n in preserved_set]
        managed = [n for n in known if n not in preserved_set]
        for name in known:
            times.setdefault(name, when_created[name])

        adopted = []
        for name in directory.list():
            if self.numbered(name) is None or name in known:
                continue
            path = directory.child(name)
            when = created(path)
            if when is None:
                continue
            if retiring(path):
                # Marked for deletion by a retention that crashed: finish it.
                self.delete(name)
                continue
            adopted.append(name)
            times[name] = when
        if adopted:
            log.warning(
                "adopting committed checkpoints the pointer does not name: %s", ", ".join(adopted)
            )
            managed = sorted(managed + adopted, key=lambda n: times[n])
        times = {n: t for n, t in times.items() if n in managed or n in preserved}
        last = meta.get("last_preserved")
        state = {
            "managed": managed,
            "preserved": preserved,
            "times": times,
            "last_preserved": float(last) if last is not None else float(self.clock()),
        }
        if adopted or (pointer is not None and known != pointer.all):
            self.write_pointer(state)
        return state

    def write_pointer(self, state: dict[str, Any]) -> None:
        """Rank 0: make the pointer name the list ``state`` (refused if another process
        moved it since this manager read or wrote it)."""
        names = [*state["preserved"], *state["managed"]]
        if not names:
            return
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "latest": names[-1],
            "all": names,
            "manager": {
                "times": state["times"],
                "preserved": state["preserved"],
                "last_preserved": state["last_preserved"],
            },
        }
        self.pointer_version = move(self.store, pointer_dumps(doc), self.pointer_version)

    def delete(self, name: str) -> None:
        """Rank 0: delete the checkpoint ``name`` so that no reader sees half of it."""
        self.withdraw(name)()

    def withdraw(self, name: str) -> Callable[[], None]:
        """Rank 0: the first part of :meth:`delete` (from now on nobody opens or adopts
        ``name``); returns the rest, which never raises (a failure is logged, and a later
        save's garbage collection finishes the deletion)."""
        where = self.store.where(name)
        try:
            rest = withdraw(self.store.child(name))
        except OSError as exc:
            log.warning("could not retire checkpoint %s: %s", where, exc)
            return lambda: None

        def finish() -> None:
            try:
                rest()
            except Exception as exc:  # off the save path: reported, finished by a later GC
                log.warning("could not finish deleting checkpoint %s: %s", where, exc)

        return finish


class Deletions:
    """The rest of each deletion of ``delete_in_background``, run by one thread (rank 0)."""

    def __init__(self) -> None:
        self._runner: ThreadPoolExecutor | None = None
        self._running: list[Future[None]] = []
        self._lock = threading.Lock()

    def start(self, rests: list[Callable[[], None]]) -> None:
        with self._lock:
            if self._runner is None:
                self._runner = ThreadPoolExecutor(1, thread_name_prefix="distckpt-delete")
            self._running += [self._runner.submit(rest) for rest in rests]

    def wait(self) -> None:
        """Wait for the deletions started so far, for at most ``DISTCKPT_TIMEOUT``
        seconds (then log and go on: a later save's garbage collection finishes them)."""
        with self._lock:
            running, self._running = self._running, []
        if running:
            limit = settings.TIMEOUT.value()
            _, late = futures.wait(running, timeout=limit)
            if late:
                log.warning(
                    "%d deletions of old checkpoints still running after %.0f s; going on",
                    len(late),
                    limit,
                )

    def close(self) -> None:
        self.wait()
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is not None:
            runner.shutdown(wait=False)

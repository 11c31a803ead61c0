"""Who owns a run directory: one :class:`~distckpt.CheckpointManager` at a time.

Across processes, rank 0 holds the directory's lease lock (:mod:`distckpt.training.lock`):
a manager on the same directory in another process fails with
:class:`~distckpt.errors.DirectoryLockedError`.

**Replacing a manager.** Within one process a new manager on a directory (the same
``os.path.realpath``, or the same URL) takes it over from the older one that is still
open, as TensorFlow's guide does for its second run and a notebook cell does when run
twice. The new manager first waits for the older one's background save (a failure there
is logged as a warning, not raised), then the lock passes from the older manager to the
new one without being released in between. From then on the older manager refuses to
save, on every rank, with :class:`~distckpt.errors.DirectoryLockedError`; it can still
restore, and its ``close()`` leaves the lock to the new manager. A closed manager is not
replaced: the new one takes the lock as usual.
"""

from __future__ import annotations

import weakref
from typing import Any

from distckpt.errors import DirectoryLockedError
from distckpt.storage.backend import Store
from distckpt.training.lock import DirectoryLock

# This process's newest owner of each directory, by key, on every rank: the one a new
# manager of that directory takes over from.
_owners: weakref.WeakValueDictionary[str, Ownership] = weakref.WeakValueDictionary()


class Ownership:
    """One manager's claim on a directory (``key``: its real path or URL): the lock on
    rank 0, and whether a newer manager of this process replaced it."""

    def __init__(self, key: str, manager: Any) -> None:
        self.key = key
        self.lock: DirectoryLock | None = None
        self.replaced = False
        self.closed = False
        self._manager = weakref.ref(manager)
        self._release_when_dropped: weakref.finalize | None = None

    def predecessor(self) -> Ownership | None:
        """The open owner of the same directory in this process, if any (every rank)."""
        older = _owners.get(self.key)
        return None if older is None or older.closed else older

    def successor_waits(self) -> None:
        """Let the older manager finish its background save (every rank)."""
        manager = self._manager()
        if manager is not None:
            manager._finish_for_successor()

    def lock_to_hand_over(self) -> DirectoryLock | None:
        """This owner's lock (rank 0; None elsewhere), unless another process took it
        over meanwhile."""
        lock = self.lock
        if lock is None or not lock.held:
            return None
        try:
            lock.check()
        except DirectoryLockedError:
            return None  # lost: the successor acquires (and is refused) as usual
        return lock

    def acquire(
        self, store: Store, stale_seconds: float, handed_over: DirectoryLock | None
    ) -> None:
        """Rank 0: take the lock handed over, else acquire the directory's lock."""
        if handed_over is not None:
            self.lock = handed_over
            return
        lock = DirectoryLock(store, stale_seconds=stale_seconds)
        lock.acquire()
        self.lock = lock

    def abandon(self, handed_over: DirectoryLock | None) -> None:
        """Rank 0, after a failed start: release a lock acquired (one handed over stays
        with the older manager)."""
        if self.lock is not None and self.lock is not handed_over:
            self.lock.release()
        self.lock = None

    def take_over(self, older: Ownership | None, handed_over: DirectoryLock | None) -> None:
        """Every rank, once the start succeeded: the older owner gives way, and this one
        becomes the directory's owner in this process."""
        if older is not None:
            older._give_way(lock_handed_over=handed_over is not None)
        manager = self._manager()
        if self.lock is not None and manager is not None:
            # A manager dropped without close() frees its directory.
            self._release_when_dropped = weakref.finalize(manager, self.lock.release)
        _owners[self.key] = self

    def _give_way(self, lock_handed_over: bool) -> None:
        """A newer manager of this directory took over: refuse saves from now on, and
        leave the lock, if handed over, to it."""
        self.replaced = True
        if lock_handed_over:
            if self._release_when_dropped is not None:
                self._release_when_dropped.detach()
            self.lock = self._release_when_dropped = None

    def refuse_if_replaced(self, directory: str) -> None:
        """Every rank: raise if a newer manager of this process replaced this one."""
        if self.replaced:
            raise DirectoryLockedError(
                f"this CheckpointManager of {directory} was replaced by a newer "
                "CheckpointManager on the same directory in this process; save through the "
                "new one"
            )

    def check_lock(self) -> None:
        """Rank 0: raise unless this process still holds the directory's lock."""
        if self.lock is not None:
            self.lock.check()

    def release(self) -> None:
        """Close: release the lock, if this owner still holds it (rank 0)."""
        self.closed = True
        if self.lock is not None:
            self.lock.release()

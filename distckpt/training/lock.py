"""A lease lock on a run directory: one :class:`~distckpt.CheckpointManager` at a time.

The lock is ``<dir>/.distckpt-lock``, a lease (:mod:`distckpt.commit.lease`) created
only if absent and renewed every :data:`HEARTBEAT_SECONDS` by a conditional write, on a
file system and on an object store alike. Another process takes the lock over when the
lease has expired (not renewed for ``stale_seconds``, :data:`STALE_SECONDS` by default)
or when the holder is on this host and its process is gone; of two processes that both
found it stale only one wins.

The lock is released by :meth:`DirectoryLock.release` (the manager's ``close()`` and
context-manager exit) and at interpreter exit. A newer manager of the same directory in
the same process is handed the :class:`DirectoryLock` object itself instead (see
:mod:`distckpt.training.manager`), so the lock is never released in between.
"""

from __future__ import annotations

import atexit
import os
import uuid
from typing import Any

from distckpt.commit.lease import HEARTBEAT_SECONDS, STALE_SECONDS, Lease
from distckpt.errors import DirectoryLockedError
from distckpt.storage.backend import Store
from distckpt.storage.registry import open_store

LOCK_FILE = ".distckpt-lock"
__all__ = [
    "HEARTBEAT_SECONDS",
    "LOCK_FILE",
    "STALE_SECONDS",
    "DirectoryLock",
    "DirectoryLockedError",
]


class DirectoryLock:
    """The lease lock of one directory, held by this process once :meth:`acquire` returns."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | Store,
        stale_seconds: float = STALE_SECONDS,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.store = open_store(directory)
        self.path = self.store.where(LOCK_FILE)
        self.stale_seconds = float(stale_seconds)
        self._lease = Lease(
            self.store,
            LOCK_FILE,
            uuid.uuid4().hex,
            stale_seconds=stale_seconds,
            heartbeat_seconds=heartbeat_seconds,
        )
        self.token = self._lease.token

    @property
    def held(self) -> bool:
        return self._lease.held

    @property
    def lost(self) -> bool:
        return self._lease.lost

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; raise :class:`DirectoryLockedError`."""

        def busy(info: dict[str, Any], age: float) -> Exception:
            return DirectoryLockedError(
                f"{self.store.url} is in use by another checkpoint manager "
                f"(host {info.get('host', '?')}, pid {info.get('pid', '?')}, lease "
                f"refreshed {age:.0f} s ago); close it first, or wait "
                f"{self.stale_seconds:.0f} s after it died"
            )

        self._lease.acquire(busy)
        atexit.register(self.release)

    def check(self) -> None:
        """Raise :class:`DirectoryLockedError` when the lock was lost to another process."""
        lease = self._lease
        if lease.lost or (lease.held and not lease.ours()):
            lease.lost = True
            raise DirectoryLockedError(
                f"the lock {self.path} was taken over by another process (its lease expired)"
            )

    def release(self) -> None:
        """Stop the lease and remove the lock if it is still ours. Idempotent."""
        if not self._lease.held:
            return
        atexit.unregister(self.release)
        self._lease.release()

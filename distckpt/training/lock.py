"""A lease lock on a run directory: one :class:`~distckpt.CheckpointManager` at a time.

The lock is a file, ``<dir>/.distckpt-lock``, created with ``O_CREAT | O_EXCL`` (atomic
on local and NFS-like shared file systems alike; no ``fcntl`` locks), holding
``{"host", "pid", "time", "token"}``. While it is held, a daemon thread refreshes the
file's modification time every :data:`HEARTBEAT_SECONDS`: the lease. Another process
takes the lock over when the lease has expired (modification time older than
``stale_seconds``, :data:`STALE_SECONDS` by default) or when the owner is on this host
and its process is gone. Taking over renames the stale file out of the way first, so of
two processes that both found it stale only one wins.

The lock is released by :meth:`DirectoryLock.release` (the manager's ``close()`` and
context-manager exit) and at interpreter exit. A newer manager of the same directory in
the same process is handed the :class:`DirectoryLock` object itself instead (see
:mod:`distckpt.training.manager`), so the file is never released in between.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from distckpt.errors import CheckpointError
from distckpt.storage.fsutil import fsync_dir

log = logging.getLogger(__name__)

LOCK_FILE = ".distckpt-lock"
HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 60.0


class DirectoryLockedError(CheckpointError):
    """Another live checkpoint manager holds the run directory's lock, took it over, or
    (in this process) replaced the manager that tries to save."""


def _read(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _pid_dead(info: dict[str, Any]) -> bool:
    """Whether ``info`` names a process on this host that no longer exists."""
    if info.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError, OverflowError):
        return False
    return False


class DirectoryLock:
    """The lease lock of one directory, held by this process once :meth:`acquire` returns."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        stale_seconds: float = STALE_SECONDS,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.path = Path(directory) / LOCK_FILE
        self.stale_seconds = float(stale_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.token = uuid.uuid4().hex
        self.lost = False
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; raise :class:`DirectoryLockedError`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._try_create():
                break
            try:
                stat = self.path.stat()
            except FileNotFoundError:
                continue  # released meanwhile: try again
            info = _read(self.path)
            age = time.time() - stat.st_mtime
            if age <= self.stale_seconds and not _pid_dead(info):
                raise DirectoryLockedError(
                    f"{self.path.parent} is in use by another checkpoint manager "
                    f"(host {info.get('host', '?')}, pid {info.get('pid', '?')}, lease "
                    f"refreshed {age:.0f} s ago); close it first, or wait "
                    f"{self.stale_seconds:.0f} s after it died"
                )
            self._take_over(stat.st_ino, info, age)
        else:
            raise DirectoryLockedError(f"could not take the lock {self.path}: contended")
        self._held = True
        self._thread = threading.Thread(target=self._beat, name="distckpt-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _try_create(self) -> bool:
        doc = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "token": self.token,
        }
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps(doc).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)
        return True

    def _take_over(self, inode: int, info: dict[str, Any], age: float) -> None:
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved it first
        try:
            if aside.stat().st_ino != inode:
                # We moved a lock taken by someone else in between: put it back.
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                return
            log.warning(
                "taking over the stale lock %s (host %s, pid %s, lease refreshed %.0f s ago)",
                self.path,
                info.get("host", "?"),
                info.get("pid", "?"),
                age,
            )
        finally:
            aside.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            if _read(self.path).get("token") != self.token:
                self.lost = True
                log.error("the lock %s was taken over by another process", self.path)
                return
            try:
                os.utime(self.path)
            except OSError:
                self.lost = True
                return

    def check(self) -> None:
        """Raise :class:`DirectoryLockedError` when the lock was lost to another process."""
        if self.lost or (self._held and _read(self.path).get("token") != self.token):
            self.lost = True
            raise DirectoryLockedError(
                f"the lock {self.path} was taken over by another process (its lease expired)"
            )

    def release(self) -> None:
        """Stop the lease and remove the lock file if it is still ours. Idempotent."""
        if not self._held:
            return
        self._held = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self.release)
        if _read(self.path).get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

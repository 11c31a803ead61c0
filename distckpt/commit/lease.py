"""A lease on one key of a store: the run directory's lock and a save's claim on a name.

The lease is a small JSON object, ``{"checksum", "host", "pid", "time", "beat", "token",
...}``, created only if absent (:meth:`~distckpt.storage.backend.Store.put_new`). It is
sealed by its checksum (:mod:`distckpt.format.seal`): a damaged one names no holder,
which is then judged by its heartbeat alone. While it is held, a daemon thread rewrites
it every ``heartbeat_seconds``, each time conditional on the version it wrote last
(:meth:`~distckpt.storage.backend.Store.put_if`), so a holder whose lease was taken over
learns it at its next beat. Another process takes the lease
over when it is stale (not written for ``stale_seconds``) or when its holder is on this
host and its process is gone, by a write conditional on the version it found stale: of
two processes that both found it stale, only one wins. The same code runs on a file
system and on an object store.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from distckpt.format import seal
from distckpt.storage.backend import ConditionFailed, Store, require

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 60.0


def read_lease(store: Store, key: str) -> tuple[dict[str, Any], str, float] | None:
    """The lease at ``key`` (its document, version, and age in seconds), or None."""
    try:
        raw, version = store.read_versioned(key)
        age = store.age(key)
    except (FileNotFoundError, NotADirectoryError):
        return None
    # A damaged lease names nobody: its holder is judged by its heartbeat alone, so a
    # flipped pid can never make a live save look dead.
    return seal.load_or_unknown(raw, store.where(key), "holder"), version, age


def pid_dead(info: dict[str, Any]) -> bool:
    """Whether ``info`` names a process on this host that no longer exists."""
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError, OverflowError):
        return False
    return False


def describe(info: dict[str, Any]) -> str:
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}"


class Lease:
    """A lease on ``key`` of ``store`` held by this process once :meth:`acquire` returns."""

    def __init__(
        self,
        store: Store,
        key: str,
        token: str,
        extra: dict[str, Any] | None = None,
        *,
        stale_seconds: float = STALE_SECONDS,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.store = store
        self.key = key
        self.token = token
        self.stale_seconds = float(stale_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        now = time.time()
        self._doc: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": now,
            "beat": now,
            "token": token,
            **(extra or {}),
        }
        self._version = ""
        self.lost = False
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._held

    @property
    def where(self) -> str:
        return self.store.where(self.key)

    def acquire(self, busy: Callable[[dict[str, Any], float], Exception]) -> None:
        """Take the lease, taking over a stale one; raise ``busy(holder, age)`` when a live
        holder has it. A store without atomic conditional writes cannot hold one: a
        :class:`~distckpt.errors.StorageError` says so."""
        require(self.store, "conditional_create", "conditional_update", doing=f"lease {self.key}")
        data = seal.encode(self._doc)
        for _ in range(3):
            try:
                self._version = self.store.put_new(self.key, data)
                break
            except ConditionFailed:
                pass
            found = read_lease(self.store, self.key)
            if found is None:
                continue  # released meanwhile: try again
            info, version, age = found
            if age <= self.stale_seconds and not pid_dead(info):
                raise busy(info, age)
            try:
                self._version = self.store.put_if(self.key, data, version)
            except (ConditionFailed, FileNotFoundError):
                continue  # someone else took it, or it was released: look again
            log.warning(
                "took over the stale lease %s (%s, last written %.0f s ago)",
                self.where,
                describe(info),
                age,
            )
            break
        else:
            raise busy({"host": "?", "pid": "?"}, 0.0)
        self._held = True
        self._thread = threading.Thread(target=self._beat, name="distckpt-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            self._doc["beat"] = time.time()
            try:
                self._version = self.store.put_if(self.key, seal.encode(self._doc), self._version)
            except (ConditionFailed, FileNotFoundError):
                if self._landed_late():
                    continue
                self.lost = True
                log.error("the lease %s was taken over by another process", self.where)
                return
            except Exception as exc:  # a transient failure: the next beat tries again
                log.debug("could not renew the lease %s: %s", self.where, exc)

    def _landed_late(self) -> bool:
        """After a renewal found another version: whether that version is still ours, a
        renewal that failed here (no answer in time) but reached the store later. Its
        version is then the one the next renewal replaces."""
        try:
            found = read_lease(self.store, self.key)
        except Exception as exc:  # no answer now either: the next beat looks again
            log.debug("could not read the lease %s: %s", self.where, exc)
            return True
        if found is None or found[0].get("token") != self.token:
            return False
        self._version = found[1]
        return True

    def ours(self) -> bool:
        """Whether the lease still names this holder (reads it)."""
        found = read_lease(self.store, self.key)
        return found is not None and found[0].get("token") == self.token

    def stop(self) -> None:
        """Stop renewing (the lease goes stale unless released)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours. Idempotent."""
        if not self._held:
            return
        self._held = False
        self.stop()
        try:
            if self.ours():
                self.store.delete(self.key)
        except Exception as exc:  # it goes stale, and is then taken over
            log.warning("could not release the lease %s: %s", self.where, exc)

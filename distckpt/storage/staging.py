"""Staging directories and the commit: "write under a temporary name, then rename".

A save writes into ``<parent>/.<name>.staging-<token>/``, never into ``<name>``. The
coordinator creates it with an owner file (host, pid, start time) whose modification time
is a heartbeat, refreshed by a daemon thread while the save runs. The commit writes the
index, fsyncs, removes the owner file and renames the directory to ``<name>``
(atomically exchanging it with an existing checkpoint when replacing one), then fsyncs
the parent. A checkpoint therefore exists under its name only once it is complete.

:func:`collect_garbage` removes staging directories whose heartbeat has stopped (or whose
owner process is gone on this host), and the ``.trash-`` directories of replaced
checkpoints; it never touches a staging directory whose heartbeat is fresh.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

from distckpt.storage.fsutil import exchange, fsync_dir, read_regular, write_file
from distckpt.storage.lease import pid_dead

log = logging.getLogger(__name__)

OWNER_FILE = ".distckpt-owner.json"
HEARTBEAT_SECONDS = 5.0
STALE_SECONDS = 60.0
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<what>staging|trash)-(?P<token>[0-9a-f]+)$")


def staging_path(final: Path, token: str) -> Path:
    return final.parent / f".{final.name}.staging-{token}"


def trash_path(final: Path, token: str) -> Path:
    return final.parent / f".{final.name}.trash-{token}"


class Staging:
    """A staging directory owned by this process (the coordinator), with its heartbeat."""

    def __init__(self, final: Path, token: str, world_size: int) -> None:
        self.final = final
        self.token = token
        self.path = staging_path(final, token)
        final.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "world_size": world_size,
            "target": final.name,
        }
        write_file(self.path / OWNER_FILE, json.dumps(owner).encode(), fsync=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="distckpt-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        owner = self.path / OWNER_FILE
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(owner)
            except OSError:
                return

    def stop_heartbeat(self) -> None:
        self._stop.set()
        self._thread.join()

    def commit(self, *, overwrite: bool) -> None:
        """Rename the finished staging directory to its final name (coordinator only).

        The caller has written and fsynced every file, including the index.
        """
        self.stop_heartbeat()
        (self.path / OWNER_FILE).unlink()
        fsync_dir(self.path)
        if self.final.exists() and overwrite:
            if exchange(self.path, self.final):
                fsync_dir(self.final.parent)
                shutil.rmtree(self.path, ignore_errors=True)  # now holds the old checkpoint
                return
            trash = trash_path(self.final, self.token)
            os.rename(self.final, trash)
            os.rename(self.path, self.final)
            fsync_dir(self.final.parent)
            shutil.rmtree(trash, ignore_errors=True)
            return
        # os.rename onto an existing non-empty directory fails: no silent overwrite.
        os.rename(self.path, self.final)
        fsync_dir(self.final.parent)

    def abort(self) -> None:
        self.stop_heartbeat()
        shutil.rmtree(self.path, ignore_errors=True)


def owner_alive(path: Path, stale_seconds: float = STALE_SECONDS) -> bool:
    """Whether the save that owns staging directory ``path`` still runs (its heartbeat is
    fresh and, on this host, its process exists)."""
    owner = path / OWNER_FILE
    try:
        age = time.time() - owner.lstat().st_mtime
        info = json.loads(read_regular(owner))
    except (OSError, ValueError, RecursionError):
        # No owner file: the save is being committed or was abandoned; judge by the dir.
        try:
            return time.time() - path.stat().st_mtime < stale_seconds
        except OSError:
            return False
    return age <= stale_seconds and not pid_dead(info)


def _complete(path: Path) -> bool:
    from distckpt.storage.index import is_committed

    return not (path / OWNER_FILE).exists() and is_committed(path)


def collect_garbage(
    directory: str | os.PathLike[str], stale_seconds: float = STALE_SECONDS
) -> list[Path]:
    """Remove abandoned staging and trash directories in ``directory``; return what went."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = LEFTOVER.match(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if match["what"] == "staging" and owner_alive(path, stale_seconds):
            continue
        final = path.parent / match["name"]
        if not final.exists() and _complete(path):
            # A crash inside a replacing commit: put the complete checkpoint back.
            log.warning("restoring %s from interrupted commit %s", final, path)
            os.rename(path, final)
            fsync_dir(final.parent)
            continue
        log.info("removing abandoned %s directory %s", match["what"], path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Staging and trash directories present in ``directory`` (live or not)."""
    try:
        return sorted(
            Path(e.path)
            for e in os.scandir(directory)
            if LEFTOVER.match(e.name) and e.is_dir(follow_symlinks=False)
        )
    except FileNotFoundError:
        return []

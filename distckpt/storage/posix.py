"""The file-system backend of the storage seam: a directory on a local or shared POSIX
file system (:mod:`distckpt.storage.backend`).

Pieces are written with ``pwritev`` at their offsets and read with ``preadv``. Durability is
explicit: a finished file is fsynced and :meth:`PosixStore.persist` fsyncs the directories
that got new entries. Conditional writes are made atomic with ``link`` (create: a
complete temporary file is linked to the name, which fails if it exists) and a
``lockf`` lock beside the file (replace: compare the version, then rename over it); the
version of a file is the crc32c of its bytes, so it survives a copy of the directory.
Directories rename atomically (``exchange`` with ``renameat2(RENAME_EXCHANGE)`` where
the file system has it), so a save commits by renaming its staging directory
(:data:`~distckpt.storage.staging.RENAME`).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import crc32c as _crc

from distckpt.errors import UnsafePathError
from distckpt.storage.backend import (
    Buffer,
    Capabilities,
    ConditionFailed,
    Store,
    byte_view,
    check_key,
)
from distckpt.storage.fsutil import (
    atomic_write,
    create_new,
    exchange,
    fsync_dir,
    open_regular,
    read_regular,
    write_file,
)
from distckpt.storage.staging import RENAME

_IOV_MAX = 1024
#: Why a hard link cannot be made where a copy can: another file system, no links there,
#: too many links to the file.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


def pwrite_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """Write ``buffers`` back to back at ``offset`` (``pwritev``; short writes finished)."""
    views = [byte_view(b) for b in buffers]
    total = 0
    for start in range(0, len(views), _IOV_MAX):
        batch = views[start : start + _IOV_MAX]
        want = sum(v.nbytes for v in batch)
        done = os.pwritev(fd, batch, offset)
        if done < want:  # rare (signals, some network file systems): finish the rest
            rest = memoryview(b"".join(bytes(v) for v in batch))[done:]
            while rest:
                n = os.pwrite(fd, rest, offset + done)
                rest, done = rest[n:], done + n
        offset += want
        total += want
    return total


def _version(data: bytes) -> str:
    return f"{_crc.crc32c(data):08x}-{len(data)}"


class PosixReader:
    """A file open for ranged reads (``preadv``)."""

    def __init__(self, path: Path) -> None:
        self._fd = open_regular(path)
        self._size: int | None = None

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = os.fstat(self._fd).st_size
        return self._size

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        return os.preadv(self._fd, [byte_view(b) for b in buffers], offset)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        # Start reading now: the task then reads chunk by chunk without waiting on the device.
        if hasattr(os, "posix_fadvise"):
            for offset, length in runs:
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> PosixReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PosixWriter:
    """A file written at offsets from several threads; opened at the first write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._lock = threading.Lock()
        self._closed = False
        self._opened = False  # the file was created (truncated) by this writer
        self._finished = False

    def _open(self) -> int:
        if self._fd < 0:
            with self._lock:
                if self._closed:
                    raise ValueError(f"{self.path} is closed")
                if self._fd < 0:
                    self._fd = create_new(self.path)
                    self._opened = True
        return self._fd

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        return pwrite_all(self._open(), buffers, offset)

    def finish(self, durable: bool = True) -> None:
        try:
            fd = self._open()
            if durable:
                os.fsync(fd)
            self._finished = True
        finally:
            self._close()

    def abort(self) -> None:
        """Close, and remove the partial file (as an object store never shows one); a
        finished file stays."""
        self._close()
        if self._opened and not self._finished:
            with suppress(OSError):
                self.path.unlink(missing_ok=True)

    def _close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            self._closed = True
        if fd >= 0:
            os.close(fd)


class PosixStore:
    """A directory of a POSIX file system (created when first written to). ``root`` is
    where links stop being followed (default: ``path`` itself; see the module)."""

    capabilities = Capabilities(
        renames=True,
        conditional_create=True,
        conditional_update=True,
        ranged_reads=True,
        parallel_writes=True,
        local_files=True,
        copies=True,
    )
    commit_strategy = RENAME

    def __init__(self, path: str | os.PathLike[str], *, root: Path | None = None) -> None:
        self.path = Path(path)
        self.url = str(self.path)
        self._root = self.path if root is None else root
        # The path's components below the root, and the root as a string: _p joins
        # strings, a hot path (pathlib costs tens of microseconds a key).
        self._below = self.path.relative_to(self._root).parts
        self._top = str(self._root)
        # Directories below the root seen not to be links (lstat once per directory).
        self._plain: set[str] = set()

    def __repr__(self) -> str:
        return f"PosixStore({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PosixStore) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> PosixStore:
        up = self.path.parent
        return PosixStore(up, root=self._root if up.is_relative_to(self._root) else None)

    def child(self, key: str) -> PosixStore:
        if not key:
            return self
        store = PosixStore(self._p(key), root=self._root)
        store._plain = self._plain
        return store

    def where(self, key: str) -> str:
        return str(self.path / key) if key else self.url

    def _p(self, key: str) -> Path:
        """The path of ``key``: inside the store, and reached through no link below the
        root (the last component is the caller's to open without following)."""
        path = self.path / check_key(key) if key else self.path
        parts = (*self._below, *key.split("/")) if key else self._below
        at = self._top
        for part in parts[:-1]:
            at = f"{at}/{part}"
            if at in self._plain:
                continue
            try:
                mode = os.lstat(at).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return path  # nothing further exists: nothing can be followed
            if stat.S_ISLNK(mode):
                raise UnsafePathError(
                    f"{path}: {at} is a symbolic link; distckpt never follows one"
                )
            self._plain.add(at)
        return path

    def _entry(self, key: str) -> Path:
        """:meth:`_p`, and the last component too may not be a link (a directory to read
        or list is never reached through one)."""
        path = self._p(key)
        if path != self._root and path.is_symlink():
            raise UnsafePathError(f"{path} is a symbolic link; distckpt never follows one")
        return path

    def read(self, key: str) -> bytes:
        return read_regular(self._p(key))

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.read(key)
        return data, _version(data)

    def open(self, key: str, size: int | None = None) -> PosixReader:
        return PosixReader(self._p(key))

    def write(self, key: str, data: Buffer) -> None:
        path = self._p(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, bytes(data))

    def create(self, key: str, size_hint: int | None = None) -> PosixWriter:
        return PosixWriter(self._p(key))

    def put_new(self, key: str, data: Buffer) -> str:
        path = self._p(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = bytes(data)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
        write_file(tmp, payload)
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: the file is whole
        except FileExistsError:
            raise ConditionFailed(f"{path} exists") from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return _version(payload)

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        path = self._p(key)
        payload = bytes(data)
        with _locked(path):
            try:
                current = _version(read_regular(path))
            except FileNotFoundError:
                raise ConditionFailed(f"{path} is gone") from None
            if current != version:
                raise ConditionFailed(f"{path} changed")
            atomic_write(path, payload)
        return _version(payload)

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._p(key))

    def age(self, key: str) -> float:
        return time.time() - os.lstat(self._p(key)).st_mtime

    def list(self, key: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._entry(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        top = self._entry(key)
        found = []
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue  # removed while we looked
                found.append((os.path.relpath(full, top), st.st_size, st.st_mtime))
        return found

    def is_dir(self, key: str) -> bool:
        try:
            path = self._p(key)
            mode = os.stat(path).st_mode if path == self._root else os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISDIR(mode)

    def stamp(self, key: str) -> str | None:
        """The file's inode, size and modification time: any write to it changes them."""
        st = os.lstat(self._p(key))
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """A hard link to ``source_key`` of ``source`` (another directory of this file
        system), checked against ``expect`` once made (the link is the same file); a copy
        of its bytes where a link cannot be made (another file system, a file system
        without links), through ``copy_file_range``, which reflinks where the file system
        can."""
        if not isinstance(source, PosixStore):
            raise TypeError(f"{self.url} copies from a directory, not from {source.url}")
        src, dst = source._entry(source_key), self._p(key)
        if not stat.S_ISREG(os.lstat(src).st_mode):
            raise UnsafePathError(f"{src} is not a regular file; not copied")
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
        else:
            if expect is not None and self.stamp(key) != expect:
                os.unlink(dst)
                raise ConditionFailed(f"{src} was written again since it was stamped")
            return
        if expect is not None and source.stamp(source_key) != expect:
            raise ConditionFailed(f"{src} was written again since it was stamped")
        fd_in = open_regular(src)
        try:
            fd_out = create_new(dst)
            try:
                left = os.fstat(fd_in).st_size
                while left:
                    done = os.copy_file_range(fd_in, fd_out, left)
                    if not done:
                        raise OSError(f"{src} ended before its size was copied")
                    left -= done
                os.fsync(fd_out)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)

    def delete(self, key: str) -> None:
        self._p(key).unlink(missing_ok=True)

    def delete_tree(self, key: str = "") -> None:
        path = self._p(key)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def rename(self, key: str, new_key: str) -> None:
        os.rename(self._p(key), self._p(new_key))

    def exchange(self, key: str, other: str) -> bool:
        return exchange(self._p(key), self._p(other))

    def touch(self, key: str) -> None:
        os.utime(self._p(key))

    def prepare(self, keys: Iterable[str]) -> None:
        made: set[Path] = set()
        for key in keys:
            parent = self._p(key).parent
            if parent not in made:
                parent.mkdir(parents=True, exist_ok=True)
                made.add(parent)

    def persist(self, keys: Iterable[str]) -> None:
        dirs: set[Path] = set()
        for key in keys:
            parts = Path(check_key(key)).parents
            dirs.update(self.path / p for p in parts)
        for d in sorted(dirs, key=lambda p: -len(p.parts)):
            fsync_dir(d)


@contextmanager
def _locked(path: Path) -> Any:
    """An exclusive lock on ``path``: against other processes a ``lockf`` lock on a file
    beside it (works on NFS v4 too), against other threads of this one a thread lock
    (``lockf`` locks belong to the process, and closing any descriptor drops them)."""
    with _thread_locks_guard:
        in_process = _thread_locks.setdefault(path, threading.Lock())
    with in_process:
        lock = path.with_name(f".{path.name}.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


_thread_locks: dict[Path, threading.Lock] = {}
_thread_locks_guard = threading.Lock()

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
(:data:`~distckpt.commit.staging.RENAME`).

Every path below the store's ``root`` is resolved without following a link at any step,
in the same system call that uses it (:mod:`distckpt.storage.beneath`): a directory of a
checkpoint swapped for a link by a racing process is an
:class:`~distckpt.errors.UnsafePathError`, never a read or a write elsewhere. The root
itself, and what leads to it, is the user's path, followed as the operating system does.
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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

import crc32c as _crc

from distckpt.errors import UnsafePathError
from distckpt.storage.backend import (
    Buffer,
    Capabilities,
    ConditionFailed,
    Store,
    check_key,
)
from distckpt.storage.beneath import DIRECTORY, Beneath
from distckpt.storage.fsutil import (
    atomic_write,
    exchange,
    fsync_fd,
    read_fd,
    read_regular,
    regular,
    syncfs,
    syncfs_kind,
    write_all,
    write_file,
)
from distckpt.storage.posix_io import PosixReader, PosixWriter

T = TypeVar("T")

#: Why a hard link cannot be made where a copy can: another file system, no links there,
#: too many links to the file.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


def _version(data: bytes) -> str:
    return f"{_crc.crc32c(data):08x}-{len(data)}"


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
        syncs=True,
        copies=True,
    )
    commit_strategy = "rename"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        root: Path | None = None,
        beneath: Beneath | None = None,
    ) -> None:
        self.path = Path(path)
        self.url = str(self.path)
        self._root = self.path if root is None else Path(root)
        # The store's directory below the root ("": the root), joined with keys as
        # strings: a hot path (pathlib costs tens of microseconds a key).
        self._below = "/".join(self.path.relative_to(self._root).parts)
        # Resolves every path below the root; shared by the stores of one root.
        self.beneath = beneath if beneath is not None else Beneath(str(self._root))
        self._syncfs: bool | None = None  # its file system's syncfs serves (can_sync)

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
        if up != self.path and up.is_relative_to(self._root):
            return PosixStore(up, root=self._root, beneath=self.beneath)
        return PosixStore(up)

    def child(self, key: str) -> PosixStore:
        if not key:
            return self
        return PosixStore(self.path / check_key(key), root=self._root, beneath=self.beneath)

    def where(self, key: str) -> str:
        return str(self.path / key) if key else self.url

    def _rel(self, key: str) -> str:
        """``key`` relative to the root (checked to stay inside the store)."""
        if not key:
            return self._below
        check_key(key)
        key = key.rstrip("/")  # "dir/": the directory itself
        return f"{self._below}/{key}" if self._below else key

    def read(self, key: str) -> bytes:
        return read_fd(self.beneath.open_regular(self._rel(key)))

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.read(key)
        return data, _version(data)

    def open(self, key: str, size: int | None = None) -> PosixReader:
        return PosixReader(self.beneath.open_regular(self._rel(key)))

    def write(self, key: str, data: Buffer) -> None:
        rel = self._rel(key)
        try:
            fd = self.beneath.create(rel)
        except FileNotFoundError:
            self.beneath.makedirs(rel.rpartition("/")[0])
            fd = self.beneath.create(rel)
        write_all(fd, bytes(data))

    def create(self, key: str, size_hint: int | None = None) -> PosixWriter:
        return PosixWriter(self.beneath, self._rel(key))

    def put_new(self, key: str, data: Buffer) -> str:
        rel, where = self._rel(key), self.where(key)
        payload = bytes(data)
        self.beneath.makedirs(rel.rpartition("/")[0])

        def put(directory: int, name: str) -> None:
            tmp = f".{name}.tmp-{uuid.uuid4().hex[:12]}"
            write_file(tmp, payload, dir_fd=directory)
            try:  # atomic, and fails if the name exists: the file is whole
                os.link(
                    tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False
                )
            except FileExistsError:
                raise ConditionFailed(f"{where} exists") from None
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=directory)
            fsync_fd(directory, where)

        self.beneath.call(rel, put)
        return _version(payload)

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        where = self.where(key)
        payload = bytes(data)

        def put(directory: int, name: str) -> None:
            with _locked(where, directory, name):
                try:
                    current = _version(read_regular(name, dir_fd=directory))
                except FileNotFoundError:
                    raise ConditionFailed(f"{where} is gone") from None
                if current != version:
                    raise ConditionFailed(f"{where} changed")
                atomic_write(name, payload, dir_fd=directory)

        self.beneath.call(self._rel(key), put)
        return _version(payload)

    def _lstat(self, key: str) -> os.stat_result:
        return self.beneath.lstat(self._rel(key))

    def exists(self, key: str) -> bool:
        try:
            self._lstat(key)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def age(self, key: str) -> float:
        return time.time() - self._lstat(key).st_mtime

    def list(self, key: str = "") -> list[str]:
        try:
            return sorted(self.beneath.listdir(self._rel(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        try:
            top = self.beneath.open(self._rel(key), DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        try:
            # fwalk opens each directory relative to the last and never enters a link.
            for dirpath, _dirs, files, fd in os.fwalk(".", dir_fd=top):
                for name in files:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        continue  # removed while we looked
                    found.append((os.path.normpath(f"{dirpath}/{name}"), st.st_size, st.st_mtime))
        finally:
            os.close(top)
        return found

    def is_dir(self, key: str) -> bool:
        try:
            mode = self._lstat(key).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISDIR(mode)

    def stamp(self, key: str) -> str | None:
        """The file's inode, size and modification time: any write to it changes them."""
        st = self._lstat(key)
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """A hard link to ``source_key`` of ``source`` (another directory of this file
        system), checked against ``expect`` once made (the link is the same file); a copy
        of its bytes where a link cannot be made (another file system, a file system
        without links), through ``copy_file_range``, which reflinks where the file system
        can."""
        if not isinstance(source, PosixStore):
            raise TypeError(f"{self.url} copies from a directory, not from {source.url}")
        src, dst = source._rel(source_key), self._rel(key)
        where = source.where(source_key)

        def link(src_dir: int, src_name: str) -> None:
            if not stat.S_ISREG(os.stat(src_name, dir_fd=src_dir, follow_symlinks=False).st_mode):
                raise UnsafePathError(f"{where} is not a regular file; not copied")

            def into(dst_dir: int, dst_name: str) -> None:
                os.link(
                    src_name,
                    dst_name,
                    src_dir_fd=src_dir,
                    dst_dir_fd=dst_dir,
                    follow_symlinks=False,
                )

            self.beneath.call(dst, into)

        try:
            source.beneath.call(src, link)
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
        else:
            if expect is not None and self.stamp(key) != expect:
                self.beneath.unlink(dst)
                raise ConditionFailed(f"{where} was written again since it was stamped")
            return
        if expect is not None and source.stamp(source_key) != expect:
            raise ConditionFailed(f"{where} was written again since it was stamped")
        fd_in = source.beneath.open_regular(src)
        try:
            fd_out = self.beneath.create(dst)
            try:
                left = os.fstat(fd_in).st_size
                while left:
                    done = os.copy_file_range(fd_in, fd_out, left)
                    if not done:
                        raise OSError(f"{where} ended before its size was copied")
                    left -= done
                os.fsync(fd_out)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)

    def delete(self, key: str) -> None:
        self.beneath.unlink(self._rel(key))

    def delete_tree(self, key: str = "") -> None:
        rel = self._rel(key)
        if rel:
            self.beneath.rmtree(rel)
            return
        # The root itself: the user's path.
        path = self.path
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        self.beneath.forget()

    def _pair(self, key: str, other: str, fn: Callable[[int, str, int, str], T]) -> T:
        """``fn`` of the directory descriptor and name of ``key``, then of ``other``."""
        b, second = self.beneath, self._rel(other)
        return b.call(
            self._rel(key), lambda d1, n1: b.call(second, lambda d2, n2: fn(d1, n1, d2, n2))
        )

    def rename(self, key: str, new_key: str) -> None:
        self._pair(
            key, new_key, lambda d1, n1, d2, n2: os.rename(n1, n2, src_dir_fd=d1, dst_dir_fd=d2)
        )

    def exchange(self, key: str, other: str) -> bool:
        return self._pair(
            key, other, lambda d1, n1, d2, n2: exchange(n1, n2, src_dir_fd=d1, dst_dir_fd=d2)
        )

    def touch(self, key: str) -> None:
        self.beneath.call(self._rel(key), lambda d, n: os.utime(n, dir_fd=d, follow_symlinks=False))

    def prepare(self, keys: Iterable[str]) -> None:
        made: set[str] = set()
        for key in keys:
            parent = self._rel(key).rpartition("/")[0]
            if parent not in made:
                self.beneath.makedirs(parent)
                made.add(parent)

    def can_sync(self) -> bool:
        if self._syncfs is None:
            try:
                self._syncfs = self._on_directory(syncfs_kind) is not None
            except OSError:
                return False  # not there yet: asked again later
        return self._syncfs

    def sync(self, keys: Iterable[str]) -> None:
        self._on_directory(lambda fd: syncfs(fd, self.path))

    def _on_directory(self, fn: Callable[[int], T]) -> T:
        """``fn(descriptor of this store's directory)``."""
        fd = self.beneath.open(self._rel(""), DIRECTORY) if self._below else self.beneath.fd()
        try:
            return fn(fd)
        finally:
            if self._below:
                os.close(fd)

    def persist(self, keys: Iterable[str]) -> None:
        dirs: set[str] = set()
        for key in keys:
            parts = check_key(key).rstrip("/").split("/")
            dirs.update("/".join(parts[:k]) for k in range(len(parts)))
        for d in sorted(dirs, key=lambda p: -p.count("/") - bool(p)):
            rel = self._rel(d)
            fd = self.beneath.open(rel, DIRECTORY)
            try:
                fsync_fd(fd, self.beneath.where(rel))
            finally:
                os.close(fd)


@contextmanager
def _locked(where: str, directory: int, name: str) -> Iterator[None]:
    """An exclusive lock on the entry ``name`` of ``directory``: against other processes
    a ``lockf`` lock on a file beside it (works on NFS v4 too), against other threads of
    this one a thread lock (``lockf`` locks belong to the process, and closing any
    descriptor drops them)."""
    with _thread_locks_guard:
        in_process = _thread_locks.setdefault(where, threading.Lock())
    with in_process:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        lock = f".{name}.lock"
        fd = regular(
            os.open(lock, flags, 0o644, dir_fd=directory),
            os.path.join(os.path.dirname(where), lock),
        )
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()

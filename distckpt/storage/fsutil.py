"""Durable file-system primitives: fsync that tolerates odd file systems, atomic writes,
atomic directory exchange.

Some file systems (certain FUSE and network mounts) refuse ``fsync`` on a directory with
EINVAL, ENOTSUP or EACCES; there the rename is as durable as the file system makes it,
and distckpt carries on rather than failing every save.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
from pathlib import Path

from distckpt.errors import UnsafePathError

log = logging.getLogger(__name__)

_TOLERATED = {errno.EINVAL, errno.ENOTSUP, errno.EACCES, errno.EPERM, errno.EBADF, errno.EISDIR}


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so the entries created or renamed in it survive a crash."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in _TOLERATED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _TOLERATED:
            raise
        log.debug("directory fsync refused on %s: %s", path, exc)
    finally:
        os.close(fd)


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _not_followed(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """``O_NOFOLLOW`` met a link at the last component: say so (else ``exc`` as it is)."""
    if exc.errno == errno.ELOOP:
        return UnsafePathError(f"{os.fspath(path)} is a symbolic link; distckpt never follows one")
    return exc


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` if it is a regular file. Never blocks and never
    follows a link at the last component: a link, a FIFO, a device or a directory is an
    :class:`~distckpt.errors.UnsafePathError` (a missing file a ``FileNotFoundError``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _not_followed(exc, path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UnsafePathError(f"{os.fspath(path)} is {kind}, not a regular file")
    return fd


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read()


def create_new(path: str | os.PathLike[str]) -> int:
    """A write-only descriptor of a new file at ``path``, replacing the entry there: a
    new inode, never the old one truncated. A file may be a hard link shared with
    another checkpoint (an incremental save's, :mod:`distckpt.engine.reuse`): writing it
    in place would change both. A symbolic link at ``path`` is refused
    (:class:`~distckpt.errors.UnsafePathError`), never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            return os.open(path, flags, 0o644)
        except FileExistsError:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise UnsafePathError(
                    f"{os.fspath(path)} is a symbolic link; distckpt never follows one"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        except OSError as exc:
            raise _not_followed(exc, path) from None
    raise FileExistsError(f"{os.fspath(path)} keeps being created by another process")


def write_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Create or replace ``path`` with ``data`` (a new file, :func:`create_new`); fsync it
    when asked."""
    fd = create_new(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temp file, fsync, rename, fsync)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_file(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE).

    Returns False where the kernel, C library or file system cannot do it; the caller then
    falls back to two renames.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))

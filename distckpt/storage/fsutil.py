"""Durable file-system primitives: fsync that tolerates odd file systems, atomic writes,
atomic directory exchange.

Some file systems (certain FUSE and network mounts) refuse ``fsync`` on a directory with
EINVAL, ENOTSUP or EACCES; there the rename is as durable as the file system makes it,
and distckpt carries on rather than failing every save.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

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


def write_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Create or truncate ``path`` with ``data``; fsync it when asked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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

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


def fsync_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """fsync a directory so the entries created or renamed in it survive a crash
    (``path`` relative to ``dir_fd`` when given)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _TOLERATED:
            return
        raise
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def fsync_fd(fd: int, what: str | os.PathLike[str] = "") -> None:
    """fsync the open directory (or file) ``fd``, tolerating file systems that refuse it."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _TOLERATED:
            raise
        log.debug("directory fsync refused on %s: %s", what or fd, exc)


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


#: How a file is opened to be read: never blocking (a FIFO), never through a link.
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: How a new file is created (see :func:`create_new`).
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of ``path`` (relative to ``dir_fd`` when given) if it is a
    regular file. Never blocks and never follows a link at the last component: a link, a
    FIFO, a device or a directory is an :class:`~distckpt.errors.UnsafePathError` (a
    missing file a ``FileNotFoundError``)."""
    try:
        fd = os.open(path, READ, dir_fd=dir_fd)
    except OSError as exc:
        raise _not_followed(exc, path) from None
    return regular(fd, path)


def regular(fd: int, path: str | os.PathLike[str]) -> int:
    """``fd`` if it is a regular file; else it is closed and an
    :class:`~distckpt.errors.UnsafePathError` naming ``path`` raised."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafePathError(f"{os.fspath(path)} is {file_kind(mode)}, not a regular file")
    return fd


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: "a FIFO", "a socket", ..."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def read_fd(fd: int) -> bytes:
    """The bytes of the open file ``fd`` (closed after)."""
    with os.fdopen(fd, "rb") as f:
        return f.read()


def read_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`)."""
    return read_fd(open_regular(path, dir_fd=dir_fd))


def create_new(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A write-only descriptor of a new file at ``path`` (relative to ``dir_fd`` when
    given), replacing the entry there: a new inode, never the old one truncated. A file
    may be a hard link shared with another checkpoint (an incremental save's,
    :mod:`distckpt.engine.reuse`): writing it in place would change both. A symbolic link
    at ``path`` is refused (:class:`~distckpt.errors.UnsafePathError`), never written
    through."""
    for _ in range(3):
        try:
            return os.open(path, CREATE, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            if stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise UnsafePathError(
                    f"{os.fspath(path)} is a symbolic link; distckpt never follows one"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path, dir_fd=dir_fd)
        except OSError as exc:
            raise _not_followed(exc, path) from None
    raise FileExistsError(f"{os.fspath(path)} keeps being created by another process")


def write_all(fd: int, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to the new file ``fd``; fsync it when asked; close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_file(
    path: str | os.PathLike[str], data: bytes, *, fsync: bool = True, dir_fd: int | None = None
) -> None:
    """Create or replace ``path`` with ``data`` (a new file, :func:`create_new`); fsync it
    when asked."""
    write_all(create_new(path, dir_fd=dir_fd), data, fsync=fsync)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temp file, fsync, rename,
    fsync). With ``dir_fd`` (a directory open for reading), ``path`` is a name in it."""
    if dir_fd is None:
        full = Path(path)
        tmp = full.with_name(f".{full.name}.tmp-{os.getpid()}")
        write_file(tmp, data)
        os.replace(tmp, full)
        fsync_dir(full.parent)
        return
    name = os.fspath(path)
    tmp_name = f".{name}.tmp-{os.getpid()}"
    write_file(tmp_name, data, dir_fd=dir_fd)
    os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    fsync_fd(dir_fd, name)


#: File systems whose ``syncfs`` writes back every file and directory entry of the file
#: system and reports a write-back that failed (with Linux 5.8 and later): ext2/3/4, XFS,
#: Btrfs, and tmpfs (which has nothing to write). Network file systems are not among them.
SYNCFS_TYPES = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x01021994: "tmpfs"}
_SYNCFS_KERNEL = (5, 8)


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (AttributeError, ValueError):
        return (0, 0)


def syncfs_kind(fd: int) -> str | None:
    """The name of the file system of ``fd`` when one :func:`syncfs` of it makes every
    file written there durable, and reports a failure (see :data:`SYNCFS_TYPES`); else
    None, and files must be fsynced one by one."""
    if os.uname().sysname != "Linux" or _kernel() < _SYNCFS_KERNEL:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type comes first (a long)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.fstatfs(fd, buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return SYNCFS_TYPES.get(int.from_bytes(buf.raw[:4], "little"))


def syncfs(fd: int, what: str | os.PathLike[str] = "") -> None:
    """Write back the whole file system of ``fd`` (``syncfs``): data, inodes and directory
    entries; an :class:`OSError` if any write-back failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}", os.fspath(what) or None)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    src_dir_fd: int = _AT_FDCWD,
    dst_dir_fd: int = _AT_FDCWD,
) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE), ``a``
    relative to ``src_dir_fd`` and ``b`` to ``dst_dir_fd`` when given.

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
    rc = renameat2(src_dir_fd, os.fsencode(a), dst_dir_fd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))

"""Paths below a directory, resolved without following a link at any step and without a
window between a check and its use.

distckpt never follows a symbolic link inside a checkpoint or a run directory: a link
there was put by someone else, and following it would read, or write, what is not the
run's. A check of each directory with ``lstat`` followed by an open by path leaves a
window in which a racing process swaps a directory for a link, so here the check and
the use are one system call. A :class:`Beneath` holds a descriptor of one directory, its
*top* (a path the user gave, whose links are followed once, when it is opened), and
opens what lies below it relative to that descriptor:

* with ``openat2(2)`` and ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``
  where the kernel has it (Linux 5.6 and later; probed once per process, as a
  container's seccomp filter may refuse it): the kernel refuses a link at any
  component, and any step out of the top;
* else one directory at a time, each opened with ``O_NOFOLLOW`` relative to the last.

An operation on an entry (rename, link, unlink, stat, mkdir, utime) acts relative to the
descriptor of its parent directory, reached the same way (:meth:`Beneath.call` and the
``*at`` system calls). A link met on the way is an
:class:`~distckpt.errors.UnsafePathError` naming the path.

The top's descriptor is opened at first use and kept (opening it for every file would
walk its path each time); in a forked child it is checked to be the same directory
before use, and when the top directory was removed or replaced (a checkpoint written
again under its name) an operation that found nothing opens it again and retries once.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

from distckpt.errors import UnsafePathError
from distckpt.storage.fsutil import CREATE, READ, create_new, regular

T = TypeVar("T")

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
#: Where ``openat2`` is system call 437 (the generic table; not mips, alpha, ia64).
_ARCHES = {"x86_64", "amd64", "aarch64", "arm64", "ppc64le", "ppc64", "s390x", "riscv64"}
_SYS_OPENAT2 = 437

#: A directory opened to act in (read: listed, fsynced) or to step through.
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_STEP = DIRECTORY | os.O_NOFOLLOW
_PATH = getattr(os, "O_PATH", 0)  # Linux: a directory stepped through, never read
#: The entry itself, a link included, for ``fstat`` (``lstat`` without a path walk).
_ENTRY = _PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: Retired descriptors of a top kept open (another thread may still be using one).
_RETIRED = 4


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _Openat2:
    """``openat2(2)`` through ``syscall(2)``, with one ``open_how`` per (flags, mode)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.syscall
        self._call.restype = ctypes.c_int
        self._nr = ctypes.c_long(_SYS_OPENAT2)
        self._size = ctypes.c_size_t(ctypes.sizeof(_OpenHow))
        self._hows: dict[tuple[int, int], tuple[_OpenHow, ctypes.c_void_p]] = {}

    def __call__(self, dir_fd: int, path: str, flags: int, mode: int) -> int:
        key = (flags, mode)
        found = self._hows.get(key)
        if found is None:
            how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE)
            found = self._hows.setdefault(key, (how, ctypes.c_void_p(ctypes.addressof(how))))
        encoded = os.fsencode(path)
        while True:
            fd: int = self._call(self._nr, dir_fd, encoded, found[1], self._size)
            if fd >= 0:
                return fd
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err), path)


def _probe() -> _Openat2 | None:
    """``openat2`` if this process may call it (kernel, architecture, seccomp), else None."""
    if sys.platform != "linux" or platform.machine().lower() not in _ARCHES:
        return None
    try:
        call = _Openat2()
        top = os.open("/", DIRECTORY)
    except (OSError, AttributeError):
        return None
    try:
        fd = call(top, ".", DIRECTORY, 0)
    except OSError:  # ENOSYS (old kernel), EPERM (seccomp), E2BIG, EINVAL
        return None
    finally:
        os.close(top)
    os.close(fd)
    return call


#: ``openat2`` (None where the process cannot call it: the walk by descriptors is used).
openat2: _Openat2 | None = _probe()

_generation = 0  # bumped in a forked child: tops are checked again there
_opening = threading.Lock()


def _forked() -> None:
    global _generation, _opening
    _generation += 1
    _opening = threading.Lock()  # held by a thread of the parent, perhaps


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _close_owned(owned: list[tuple[int, int]]) -> None:
    pid = os.getpid()
    for fd, opener in owned:
        if opener == pid:  # a descriptor inherited through fork is the parent's
            with suppress(OSError):
                os.close(fd)
    owned.clear()


def _is_plain(dir_fd: int, name: str) -> bool:
    """Whether the entry is neither a link nor a directory (a file in the way)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return True
    return not (stat.S_ISLNK(mode) or stat.S_ISDIR(mode))


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class Beneath:
    """The entries below the directory ``top`` (a path: its links are the user's and are
    followed; nothing below it is). ``rel`` arguments are ``/``-separated paths relative
    to the top, already checked to hold no empty, ``.`` or ``..`` component
    (:func:`~distckpt.storage.backend.check_key`); ``""`` is the top itself."""

    def __init__(self, top: str) -> None:
        self.top = top
        self._fd = -1
        self._gen = -1
        self._ident = (0, 0)
        self._owned: list[tuple[int, int]] = []  # (descriptor, pid that opened it)
        self._finalizer: weakref.finalize | None = None

    def __reduce__(self) -> tuple[type[Beneath], tuple[str]]:
        return Beneath, (self.top,)  # a descriptor means nothing in another process

    def __repr__(self) -> str:
        return f"Beneath({self.top!r})"

    def where(self, rel: str) -> str:
        """The path of ``rel``, for messages."""
        return f"{self.top.rstrip('/')}/{rel}" if rel else self.top

    # -- the top's descriptor

    def fd(self) -> int:
        """The top's descriptor (:class:`FileNotFoundError` while it does not exist)."""
        if self._fd >= 0 and self._gen == _generation:
            return self._fd
        return self._open_top()

    def _open_top(self, *, replace: bool = False) -> int:
        with _opening:
            if self._fd >= 0 and not replace:
                if self._gen == _generation:
                    return self._fd
                try:  # forked: the inherited descriptor, if it is still this directory
                    st = os.fstat(self._fd)
                    if (st.st_dev, st.st_ino) == self._ident and stat.S_ISDIR(st.st_mode):
                        self._owned.append((self._fd, os.getpid()))
                        self._gen = _generation
                        return self._fd
                except OSError:
                    pass
            fd = os.open(self.top, DIRECTORY)  # the user's path: links on the way followed
            st = os.fstat(fd)
            pid = os.getpid()
            if self._finalizer is None:
                self._finalizer = weakref.finalize(self, _close_owned, self._owned)
            self._owned.append((fd, pid))
            mine = [o for o in self._owned if o[1] == pid]
            if len(mine) > _RETIRED + 1:  # the oldest retired one: long out of use
                with suppress(OSError):
                    os.close(mine[0][0])
                self._owned.remove(mine[0])
            self._fd, self._ident, self._gen = fd, (st.st_dev, st.st_ino), _generation
            return fd

    def _again_if_replaced(self, op: Callable[[int], T]) -> T:
        """``op(top's descriptor)``; once more with the new top if it found nothing because
        the top directory was replaced meanwhile (see :meth:`_replaced`)."""
        top = self.fd()
        try:
            return op(top)
        except FileNotFoundError:
            if not self._replaced(top):
                raise
        return op(self.fd())

    def _replaced(self, fd: int) -> bool:
        """After an operation relative to ``fd`` found nothing: whether the top is now
        another directory (the one held was removed or renamed); if so it is opened
        again."""
        try:
            st = os.stat(self.top)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) == self._ident or not stat.S_ISDIR(st.st_mode):
            return False
        if self._fd == fd:
            self._open_top(replace=True)
        return True

    def forget(self) -> None:
        """The top was removed by this process: open it again at the next use."""
        with _opening:
            self._gen = -1
            self._fd = -1

    # -- resolving

    def _unsafe(self, exc: OSError, top: int, rel: str) -> OSError:
        """``exc`` from resolving ``rel``; a link met (or a step out) as an
        :class:`UnsafePathError` naming it."""
        if exc.errno == errno.EXDEV:
            return UnsafePathError(f"{self.where(rel)} leads outside {self.top}")
        if exc.errno != errno.ELOOP:
            return exc
        parts = rel.split("/")
        for k in range(1, len(parts) + 1):  # the first component that is a link
            if _is_link(top, "/".join(parts[:k])):
                return _link_error(self.where(rel), self.where("/".join(parts[:k])))
        return _link_error(self.where(rel), None)

    def _open(self, top: int, rel: str, flags: int, mode: int) -> int:
        if openat2 is not None:
            try:
                return openat2(top, rel or ".", flags, mode)
            except OSError as exc:
                raise self._unsafe(exc, top, rel) from None
        if not rel:
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=top)
        parts = rel.split("/")
        *steps, last = parts
        if flags & os.O_DIRECTORY:  # a link there would be ENOTDIR: tell it apart
            steps, last = parts, "."
        at, opened = top, []
        try:
            for k, part in enumerate(steps):
                at = self._step(at, part, rel, "/".join(parts[: k + 1]))
                opened.append(at)
            try:
                return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=at)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                    raise _link_error(self.where(rel), None) from None
                raise
        finally:
            for fd in opened:
                os.close(fd)

    def _step(self, at: int, part: str, rel: str, prefix: str) -> int:
        """A descriptor of the directory ``part`` of ``at``, which is ``prefix`` of
        ``rel``; a link there is an :class:`UnsafePathError`."""
        if not _PATH:  # no O_PATH: a link is ELOOP, or ENOTDIR with O_DIRECTORY
            try:
                return os.open(part, _STEP, dir_fd=at)
            except OSError as exc:
                # ENOTDIR from an entry that is now a link or a directory: a link then,
                # or swapped meanwhile; either way not a plain file in the way.
                if exc.errno == errno.ELOOP or (
                    exc.errno == errno.ENOTDIR and not _is_plain(at, part)
                ):
                    raise _link_error(self.where(rel), self.where(prefix)) from None
                raise
        fd = os.open(part, _PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
        try:
            mode = os.fstat(fd).st_mode  # what was opened: no second look at the name
        except BaseException:
            os.close(fd)
            raise
        if stat.S_ISDIR(mode):
            return fd
        os.close(fd)
        if stat.S_ISLNK(mode):
            raise _link_error(self.where(rel), self.where(prefix))
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.where(prefix))

    def open(self, rel: str, flags: int, mode: int = 0o644) -> int:
        """A descriptor of ``rel`` opened with ``flags`` (``O_CLOEXEC`` added), no link
        followed on the way or at the end."""
        return self._again_if_replaced(lambda top: self._open(top, rel, flags, mode))

    def _with_open(self, rel: str, flags: int, fn: Callable[[int], T]) -> T:
        """``fn(descriptor of rel opened with flags)``, the descriptor closed after."""
        fd = self.open(rel, flags)
        try:
            return fn(fd)
        finally:
            os.close(fd)

    def call(self, rel: str, fn: Callable[[int, str], T]) -> T:
        """``fn(descriptor of rel's directory, rel's last component)``: what an ``*at``
        system call needs to act on the entry ``rel`` (not the top) itself."""
        head, _, name = rel.rpartition("/")
        return self._again_if_replaced(lambda top: self._call(top, head, name, fn))

    def _call(self, top: int, head: str, name: str, fn: Callable[[int, str], T]) -> T:
        if not head:
            return fn(top, name)
        at = self._open(top, head, DIRECTORY, 0)
        try:
            return fn(at, name)
        finally:
            os.close(at)

    # -- operations

    def lstat(self, rel: str) -> os.stat_result:
        """The entry's own status (a link's, not its target's)."""
        if not rel:
            return os.fstat(self.fd())
        if not _PATH:  # no O_PATH to open a link itself with: stat it in its directory
            return self.call(rel, _lstat_at)
        return self._with_open(rel, _ENTRY, os.fstat)

    def open_regular(self, rel: str) -> int:
        """A read-only descriptor of the regular file ``rel`` (never blocking: a FIFO, a
        device or a directory is an :class:`UnsafePathError`)."""
        return regular(self.open(rel, READ), self.where(rel))

    def create(self, rel: str) -> int:
        """A write-only descriptor of a new file at ``rel``, replacing the entry there (a
        new inode: see :func:`~distckpt.storage.fsutil.create_new`)."""
        try:
            return self.open(rel, CREATE)
        except FileExistsError:
            pass

        def replace(dir_fd: int, name: str) -> int:
            if _is_link(dir_fd, name):
                raise _link_error(self.where(rel), None)
            return create_new(name, dir_fd=dir_fd)

        return self.call(rel, replace)

    def makedirs(self, rel: str) -> None:
        """Create the directory ``rel`` and those on the way (the top too) as needed; a
        link on the way is an :class:`UnsafePathError`, never followed."""
        try:
            top = self.fd()
        except FileNotFoundError:
            os.makedirs(self.top, exist_ok=True)  # the user's path
            top = self.fd()
        if not rel:
            return
        try:
            os.close(self._open(top, rel, DIRECTORY, 0))
            return
        except FileNotFoundError:
            pass
        try:
            self._makedirs(top, rel)
        except FileNotFoundError:
            if not self._replaced(top):
                raise
            self._makedirs(self.fd(), rel)

    def _makedirs(self, top: int, rel: str) -> None:
        at, opened = top, []
        parts = rel.split("/")
        try:
            for k, part in enumerate(parts):
                with suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=at)
                at = self._step(at, part, rel, "/".join(parts[: k + 1]))
                opened.append(at)
        finally:
            for fd in opened:
                os.close(fd)

    def listdir(self, rel: str) -> list[str]:
        """The names in the directory ``rel``."""
        return self._with_open(rel, DIRECTORY, os.listdir)

    def unlink(self, rel: str) -> None:
        """Remove the entry ``rel`` (not a directory; nothing there: nothing happens)."""
        with suppress(FileNotFoundError):
            self.call(rel, _unlink)

    def rmtree(self, rel: str) -> None:
        """Remove ``rel`` and everything below it (a link there: the link alone)."""
        with suppress(FileNotFoundError):
            self.call(rel, rmtree_at)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _unlink(dir_fd: int, name: str) -> None:
    os.unlink(name, dir_fd=dir_fd)


def _link_error(path: str, link: str | None) -> UnsafePathError:
    if link is None or link == path:
        return UnsafePathError(f"{path} is a symbolic link; distckpt never follows one")
    return UnsafePathError(f"{path}: {link} is a symbolic link; distckpt never follows one")


def rmtree_at(dir_fd: int, name: str) -> None:
    """Remove the entry ``name`` of ``dir_fd`` and, if it is a directory, what it holds,
    never through a link (``shutil.rmtree``'s descriptor-based walk)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)


_ROOT = Beneath("/")


def open_resolved(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``: a path resolved earlier
    (``os.path.realpath``: links the user chose are behind it) and checked by the caller,
    opened without following a link at any component, so that a directory swapped for a
    link since the check is refused, never followed."""
    return _ROOT.open_regular(os.path.abspath(path).lstrip("/"))

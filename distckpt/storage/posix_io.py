"""The POSIX store's handles: a file read at offsets (``preadv``) and a file written at
offsets from several threads (``pwritev``), created at its first write."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from distckpt.storage.backend import Buffer, byte_view
from distckpt.storage.beneath import Beneath

_IOV_MAX = 1024


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


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` with the file it is about (a full disk's ``ENOSPC`` from ``pwritev``
    names none), as the same OSError subclass, so callers catch it as before."""
    if exc.filename is not None or exc.errno is None:
        return exc
    named = type(exc)(exc.errno, exc.strerror, str(path))
    named.__traceback__ = exc.__traceback__
    return named


class PosixReader:
    """A file open for ranged reads (``preadv``): ``fd``, a regular file's descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
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
    """A file written at offsets from several threads; created at the first write."""

    def __init__(self, beneath: Beneath, rel: str) -> None:
        self.path = Path(beneath.where(rel))
        self._beneath, self._rel = beneath, rel
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
                    self._fd = self._beneath.create(self._rel)
                    self._opened = True
        return self._fd

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        try:
            return pwrite_all(self._open(), buffers, offset)
        except OSError as exc:
            raise _naming(exc, self.path) from None

    def finish(self, durable: bool = True) -> None:
        try:
            fd = self._open()
            if durable:
                os.fsync(fd)
            self._finished = True
        except OSError as exc:
            raise _naming(exc, self.path) from None
        finally:
            self._close()

    def abort(self) -> None:
        """Close, and remove the partial file (as an object store never shows one); a
        finished file stays."""
        self._close()
        if self._opened and not self._finished:
            with suppress(OSError):
                self._beneath.unlink(self._rel)

    def _close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            self._closed = True
        if fd >= 0:
            os.close(fd)

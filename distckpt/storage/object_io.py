"""What an object store is made of: the few primitives of a flat key space
(:class:`Objects`), and the read and write handles built on them (:class:`ObjectReader`,
:class:`ObjectWriter`). :class:`~distckpt.storage.object_store.ObjectStore` builds the
rest of the :class:`~distckpt.storage.backend.Store` protocol on the same primitives.

A primitive takes full paths: the service's own keys, the store's prefix included, with
no leading ``/``. The store checks every key a caller gives it
(:func:`~distckpt.storage.backend.check_key`) before it makes a path of it, so a primitive
never sees a key that leads outside the store.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from distckpt.errors import ConditionFailed, StorageError, UnsafePathError
from distckpt.storage.backend import Buffer, byte_view
from distckpt.storage.parts import cut

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """One object, as :meth:`Objects.head` or :meth:`Objects.scan` tells of it."""

    #: Its full path.
    path: str
    size: int
    #: When it was last written, in seconds since the epoch.
    modified: float
    #: The version :meth:`Objects.put` takes as ``if_version`` ("" where a listing does
    #: not say).
    version: str = ""


class Objects(ABC):
    """The primitives of a flat key space, and how their failures become distckpt's.

    Six are required: :meth:`get`, :meth:`get_into`, :meth:`put`, :meth:`head`,
    :meth:`scan` and :meth:`remove`. The others have defaults made of those:
    :meth:`scan_level`, :meth:`get_runs` and :meth:`put_parts` (a service that does them
    in one request overrides them), and the four upload primitives, used only where
    :attr:`uploads_parts` is set.

    The store runs each primitive through :meth:`call`, which names the operation; a
    primitive raises :class:`FileNotFoundError` for a missing object and
    :class:`~distckpt.errors.ConditionFailed` for a failed condition, either itself or
    through :meth:`translate` (which maps a client's own errors). Every other failure
    should end as a :class:`~distckpt.errors.StorageError` naming the location and the
    operation, and never a credential.
    """

    #: The service answers a ranged read that starts at or runs past an object's end
    #: with the bytes there are (a short read). Where it refuses such a range, False: the
    #: reader then cuts each range at the object's size first (one :meth:`head` per
    #: handle when the size was not given).
    reads_past_end: ClassVar[bool] = True
    #: The service has multipart uploads (:meth:`start_upload`, :meth:`put_part`,
    #: :meth:`complete_upload`, :meth:`abort_upload`): a part is uploaded by the thread
    #: whose write fills it. False: an object is gathered in memory and put when finished.
    uploads_parts: ClassVar[bool] = False
    #: The most paths one :meth:`remove` is given.
    remove_batch: ClassVar[int] = 1000

    @property
    def part_bytes(self) -> int:
        """Bytes per part of an object being written (at least 5 MiB: see
        :func:`~distckpt.storage.parts.part_size`)."""
        return 8 << 20

    # -- required -----------------------------------------------------------------------

    @abstractmethod
    def get(self, path: str) -> tuple[bytes, str]:
        """The object's bytes and its version."""

    @abstractmethod
    def get_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` (of one byte per item, together at least one byte) in turn
        from ``offset``; return the bytes read, fewer at the object's end (and 0 past it,
        unless :attr:`reads_past_end` is False: then no range reaches past the end)."""

    @abstractmethod
    def put(
        self, path: str, data: Buffer, *, if_absent: bool = False, if_version: str | None = None
    ) -> str:
        """Create or replace the object, whole for readers at once, durably; with
        ``if_absent`` only if there is none, with ``if_version`` only if it is still at
        that version (else :class:`~distckpt.errors.ConditionFailed`), atomically against
        every writer, on any host. Returns its new version: a string that changes with
        every write (it may name the bytes: the same bytes again may give the same one)."""

    @abstractmethod
    def head(self, path: str) -> ObjectInfo:
        """The object at ``path`` (not a prefix: :class:`FileNotFoundError` if none)."""

    @abstractmethod
    def scan(self, prefix: str, limit: int | None = None) -> Iterable[ObjectInfo]:
        """Every object whose path starts with ``prefix`` (``""`` or ending in ``/``), in
        any order; ``limit``: the caller needs no more than that many."""

    @abstractmethod
    def remove(self, paths: Sequence[str]) -> None:
        """Delete the objects (at most :attr:`remove_batch`; one absent is no error)."""

    # -- with defaults ------------------------------------------------------------------

    def scan_level(self, prefix: str) -> Iterable[str]:
        """The paths of the objects directly under ``prefix`` (``""`` or ending in ``/``)
        and of the prefixes there (ending in ``/``), as a listing with a delimiter gives
        them; repeats are allowed. The default asks :meth:`scan`."""
        cut_at = len(prefix)
        for found in self.scan(prefix):
            name, below, _ = found.path[cut_at:].partition("/")
            yield prefix + name + below

    def get_runs(self, path: str, runs: Sequence[tuple[int, int]]) -> list[Buffer]:
        """The bytes of each ``(offset, length)`` run (each at least one byte), cut short
        at the object's end. The default makes one :meth:`get_into` a run."""
        fetched: list[Buffer] = []
        for offset, length in runs:
            view = memoryview(bytearray(length))
            fetched.append(view[: self.get_into(path, offset, [view])])  # without a copy
        return fetched

    def put_parts(self, path: str, parts: Sequence[bytearray]) -> None:
        """Put an object of several ``parts``, each but the last of the writer's part
        size (:meth:`put` without a condition). The default joins them."""
        self.put(path, b"".join(parts))

    def start_upload(self, path: str) -> str:
        """Begin a multipart upload of ``path``; its id."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def put_part(self, path: str, upload: str, number: int, body: bytearray) -> str:
        """Upload part ``number`` (from 1) of ``upload``; the tag that completes it."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def complete_upload(self, path: str, upload: str, tags: Sequence[str], size: int) -> None:
        """Make the object of the parts with ``tags`` (in order; ``size`` bytes in all)."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def abort_upload(self, path: str, upload: str) -> None:
        """Give the upload up: its parts are dropped."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    # -- errors -------------------------------------------------------------------------

    def call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """``fn()``: the primitives of operation ``op`` (``"read"``, ``"write"``,
        ``"list"``, ...) about ``path``, a failure made distckpt's by :meth:`translate`.
        Errors that are already distckpt's pass as they are."""
        start = time.monotonic()
        try:
            return fn()
        except (StorageError, ConditionFailed, UnsafePathError):
            raise
        except Exception as exc:
            error = self.translate(exc, op, path, time.monotonic() - start)
            if error is exc:
                raise
            raise error from None

    def translate(self, exc: Exception, op: str, path: str, waited: float) -> BaseException:
        """The error to raise for ``exc``, raised by a primitive of ``op`` about ``path``
        after ``waited`` seconds. The default keeps it (an :class:`OSError` of a file
        system is already what distckpt expects)."""
        return exc


def fill(buffers: Sequence[memoryview], data: memoryview) -> int:
    """Copy ``data`` into ``buffers`` in turn, as far as both go; the bytes copied."""
    at = 0
    for view in buffers:
        take = min(view.nbytes, len(data) - at)
        view[:take] = data[at : at + take]
        at += take
    return at


def _first(buffers: Sequence[memoryview], length: int) -> list[memoryview]:
    """The first ``length`` bytes of ``buffers``, as views of them."""
    kept = []
    for view in buffers:
        if length <= 0:
            break
        kept.append(view[:length])
        length -= view.nbytes
    return kept


class ObjectReader:
    """Ranged reads of one object (a :class:`~distckpt.storage.backend.ReadHandle`): the
    runs :meth:`will_need` announces are fetched at once (:meth:`Objects.get_runs`) and
    the reads that fall inside them served from memory; any other read is one
    :meth:`Objects.get_into`."""

    def __init__(self, objects: Objects, path: str, size: int | None) -> None:
        self._objects = objects
        self._path = path
        self._size = size
        self._runs: list[tuple[int, memoryview]] = []

    @property
    def size(self) -> int:
        if self._size is None:
            objects, path = self._objects, self._path
            self._size = objects.call("stat", path, lambda: objects.head(path)).size
        return self._size

    def _cut(self, offset: int, length: int) -> int:
        """``length``, cut at the object's end where the service refuses to read past it."""
        if self._objects.reads_past_end:
            return length
        return max(0, min(length, self.size - offset))

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        views = [byte_view(b) for b in buffers]
        want = sum(v.nbytes for v in views)
        if want == 0:
            return 0
        for start, data in self._runs:
            if start <= offset and offset + want <= start + len(data):
                return fill(views, data[offset - start :])
        want = self._cut(offset, want)
        if want == 0:
            return 0
        objects, path, views = self._objects, self._path, _first(views, want)
        return objects.call("read", path, lambda: objects.get_into(path, offset, views))

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.readinto([buf], offset)
        return bytes(buf[:got])

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        cut_runs = [(offset, self._cut(offset, length)) for offset, length in runs]
        wanted = [run for run in cut_runs if run[1]]
        objects, path = self._objects, self._path
        got = iter(
            objects.call("read", path, lambda: objects.get_runs(path, wanted)) if wanted else ()
        )
        self._runs = [(o, memoryview(next(got) if n else b"")) for o, n in cut_runs]

    def close(self) -> None:
        self._runs = []

    def __enter__(self) -> ObjectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectWriter:
    """One object written at offsets from several threads, each byte once (a
    :class:`~distckpt.storage.backend.WriteHandle`), gathered in parts of
    :attr:`part_bytes`.

    Where the service uploads parts (:attr:`Objects.uploads_parts`), the thread whose write
    completes a part uploads it, and :meth:`finish` uploads the rest (the first part,
    which holds a shard's checksum table, and the last) and completes the upload.
    Otherwise :meth:`finish` puts the object whole (:meth:`Objects.put_parts`). An object
    of one part is one :meth:`Objects.put` either way. ``where`` names it in messages.
    """

    def __init__(self, objects: Objects, path: str, where: str, part_bytes: int) -> None:
        self._objects = objects
        self._path = path
        self._where = where
        self.part_bytes = part_bytes
        self._lock = threading.Lock()
        self._buffers: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._sent: dict[int, str] = {}  # part: the tag its upload was given
        self._end = 0
        self._upload: str | None = None
        self._done = False

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        total = 0
        complete: list[int] = []
        for part, within, data in cut(buffers, offset, self.part_bytes):
            with self._lock:
                if self._done:
                    raise ValueError(f"{self._where} is closed")
                buf = self._buffers.get(part)
                if buf is None:
                    if part in self._sent:
                        raise ValueError(f"part {part} of {self._where} written twice")
                    buf = self._buffers[part] = bytearray(self.part_bytes)
                    self._filled[part] = 0
            buf[within : within + data.nbytes] = data
            with self._lock:
                self._filled[part] += data.nbytes
                self._end = max(self._end, part * self.part_bytes + within + data.nbytes)
                if self._filled[part] == self.part_bytes and self._objects.uploads_parts:
                    complete.append(part)
            total += data.nbytes
        for part in complete:
            self._send(part, self.part_bytes)
        return total

    def _begin(self) -> str:
        objects, path = self._objects, self._path
        with self._lock:
            if self._upload is None:
                self._upload = objects.call("upload", path, lambda: objects.start_upload(path))
            return self._upload

    def _body(self, part: int, length: int) -> bytearray:
        """Part ``part``'s buffer, cut in place to ``length`` (never written: zeros)."""
        with self._lock:
            buf = self._buffers.pop(part, None)
            self._filled.pop(part, None)
        if buf is None:
            buf = bytearray(length)
        del buf[length:]  # in place: the body is the part's own buffer, not a copy
        return buf

    def _send(self, part: int, length: int) -> None:
        upload = self._begin()
        objects, path, body = self._objects, self._path, self._body(part, length)
        tag = objects.call("upload", path, lambda: objects.put_part(path, upload, part + 1, body))
        with self._lock:
            self._sent[part] = tag

    def finish(self, durable: bool = True) -> None:
        with self._lock:
            if self._done:
                raise ValueError(f"{self._where} is closed")
            end, started = self._end, self._upload is not None
        last = (end - 1) // self.part_bytes if end else 0
        lengths = [self.part_bytes] * last + [end - last * self.part_bytes]
        try:
            if started or (last and self._objects.uploads_parts):
                self._complete(lengths, end)
            else:
                self._put_whole(lengths)
        except BaseException:
            self.abort()
            raise
        finally:
            with self._lock:
                self._done = True
                self._buffers.clear()

    def _put_whole(self, lengths: Sequence[int]) -> None:
        objects, path = self._objects, self._path
        bodies = [self._body(part, length) for part, length in enumerate(lengths)]
        if len(bodies) == 1:
            objects.call("write", path, lambda: objects.put(path, bodies[0]))
        else:
            objects.call("upload", path, lambda: objects.put_parts(path, bodies))

    def _complete(self, lengths: Sequence[int], size: int) -> None:
        """Upload the parts not sent yet, and complete the upload."""
        for part, length in enumerate(lengths):
            if part not in self._sent:
                self._send(part, length)
        objects, path, upload = self._objects, self._path, self._begin()
        tags = [self._sent[part] for part in range(len(lengths))]
        objects.call("upload", path, lambda: objects.complete_upload(path, upload, tags, size))
        self._upload = None

    def abort(self) -> None:
        with self._lock:
            self._done = True
            self._buffers.clear()
            upload, self._upload = self._upload, None
        if upload is not None:
            objects, path = self._objects, self._path
            try:
                objects.call("abort", path, lambda: objects.abort_upload(path, upload))
            except Exception as exc:  # gc aborts what is left
                log.debug("abort of %s failed: %s", self._where, exc)

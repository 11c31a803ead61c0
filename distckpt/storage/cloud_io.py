"""Reads and writes of one Azure or GCS object (see :mod:`distckpt.storage.cloud`):
concurrent ranged reads (:class:`CloudReader`), and objects gathered in parts from any
number of threads and uploaded when finished (:class:`CloudWriter`)."""

from __future__ import annotations

import builtins
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from distckpt.storage.backend import Buffer, byte_view
from distckpt.storage.parts import cut, part_size

if TYPE_CHECKING:
    from distckpt.storage.cloud import CloudStore

#: Parts of one object uploaded at once.
UPLOAD_CONCURRENCY = 8


class CloudReader:
    """Ranged reads of one object; runs announced by :meth:`will_need` are fetched
    together, concurrently, and the reads that fall inside them served from memory."""

    def __init__(self, store: CloudStore, key: str, size: int | None) -> None:
        self._store = store
        self._key = key
        self._size = size
        self._runs: list[tuple[int, memoryview]] = []

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = int(self._store.head(self._key)["size"])
        return self._size

    def _ranges(self, runs: Sequence[tuple[int, int]]) -> builtins.list[memoryview]:
        """The bytes of each ``(offset, length)`` run, cut short at the object's end."""
        clipped = [(offset, max(0, min(length, self.size - offset))) for offset, length in runs]
        wanted = [(o, n) for o, n in clipped if n]
        path = self._store._key(self._key)
        got = iter(
            self._store.call(
                "read",
                self._key,
                lambda o, c: o.get_ranges(
                    c, path, starts=[o for o, _ in wanted], lengths=[n for _, n in wanted]
                ),
            )
            if wanted
            else ()
        )
        return [memoryview(next(got)) if n else memoryview(b"") for _, n in clipped]

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        views = [byte_view(b) for b in buffers]
        want = sum(v.nbytes for v in views)
        if want == 0:
            return 0
        for start, data in self._runs:
            if start <= offset and offset + want <= start + len(data):
                data = data[offset - start : offset - start + want]
                break
        else:
            data = self._ranges([(offset, want)])[0]
        at = 0
        for v in views:
            take = min(v.nbytes, len(data) - at)
            v[:take] = data[at : at + take]
            at += take
        return at

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.readinto([buf], offset)
        return bytes(buf[:got])

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        self._runs = list(zip((offset for offset, _ in runs), self._ranges(runs), strict=True))

    def close(self) -> None:
        self._runs = []

    def __enter__(self) -> CloudReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CloudWriter:
    """One object written at offsets from several threads, each byte once, gathered in
    parts (:func:`~distckpt.storage.parts.part_size`) and uploaded by :meth:`finish`."""

    def __init__(self, store: CloudStore, key: str, size_hint: int | None, part_bytes: int) -> None:
        self._store = store
        self._key = key
        self.part_bytes = part_size(part_bytes, size_hint)
        self._lock = threading.Lock()
        self._parts: dict[int, bytearray] = {}
        self._end = 0
        self._done = False

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        total = 0
        for part, within, data in cut(buffers, offset, self.part_bytes):
            with self._lock:
                if self._done:
                    raise ValueError(f"{self._store.where(self._key)} is closed")
                buf = self._parts.get(part)
                if buf is None:
                    buf = self._parts[part] = bytearray(self.part_bytes)
                self._end = max(self._end, part * self.part_bytes + within + data.nbytes)
            buf[within : within + data.nbytes] = data
            total += data.nbytes
        return total

    def finish(self, durable: bool = True) -> None:
        with self._lock:
            if self._done:
                raise ValueError(f"{self._store.where(self._key)} is closed")
            self._done = True
            end, parts = self._end, self._parts
            self._parts = {}
        count = max(1, math.ceil(end / self.part_bytes))
        bodies = []
        for number in range(count):
            # A part never written is a gap: zeros. The last is cut in place to the end.
            body = parts.get(number) or bytearray(self.part_bytes)
            del body[min(self.part_bytes, end - number * self.part_bytes) :]
            bodies.append(body)
        path = self._store._key(self._key)
        if count == 1:
            self._store.call("write", self._key, lambda o, c: o.put(c, path, bodies[0]))
            return
        self._store.call(
            "upload",
            self._key,
            lambda o, c: o.put(
                c,
                path,
                bodies,
                chunk_size=self.part_bytes,
                max_concurrency=UPLOAD_CONCURRENCY,
            ),
        )

    def abort(self) -> None:
        with self._lock:
            self._done = True
            self._parts = {}

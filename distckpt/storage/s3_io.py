"""Reads and writes of one S3 object: ranged GETs (:class:`S3Reader`) and multipart
uploads whose parts are sent as they fill, in any order (:class:`S3Writer`)."""

from __future__ import annotations

import builtins
import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from distckpt.storage.backend import Buffer, byte_view
from distckpt.storage.parts import cut, part_size
from distckpt.storage.s3_service import body_retry, client, error_code

if TYPE_CHECKING:
    from distckpt.storage.s3 import S3Store

log = logging.getLogger("distckpt.storage.s3")


def multipart_etag(etags: Sequence[str]) -> str:
    """The ETag S3 gives the object a multipart upload of parts with ``etags`` makes: the
    MD5 of the parts' MD5s, then ``-`` and their count (not so under SSE-KMS: there the
    check fails, safely)."""
    digests = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    return f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"'


class S3Reader:
    """Ranged reads of one object; runs announced by :meth:`will_need` are fetched whole
    (one GET each) and the reads that fall inside them served from memory."""

    def __init__(self, store: S3Store, key: str, size: int | None) -> None:
        self._store = store
        self._key = key
        self._size = size
        self._runs: list[tuple[int, memoryview]] = []

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = int(self._store.head(self._key)["ContentLength"])
        return self._size

    def _get(self, buffers: Sequence[memoryview], offset: int) -> int:
        want = sum(b.nbytes for b in buffers)
        if want == 0:
            return 0
        store = self._store

        def get() -> int:
            try:
                response = client().get_object(
                    Bucket=store.bucket,
                    Key=store._key(self._key),
                    Range=f"bytes={offset}-{offset + want - 1}",
                )
            except Exception as exc:
                if error_code(exc) in {"InvalidRange", "416"}:
                    return 0  # past the end: a short read, as from a file
                raise
            body = response["Body"]
            got = 0
            for buf in buffers:
                filled = 0
                while filled < buf.nbytes:
                    n = body.readinto(buf[filled:])
                    if not n:
                        return got + filled
                    filled += n
                got += filled
            return got

        return store.call("read", self._key, lambda: body_retry(get))

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        views = [byte_view(b) for b in buffers]
        want = sum(v.nbytes for v in views)
        for start, data in self._runs:
            if start <= offset and offset + want <= start + len(data):
                at = offset - start
                for v in views:
                    v[:] = data[at : at + v.nbytes]
                    at += v.nbytes
                return want
        return self._get(views, offset)

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.readinto([buf], offset)
        return bytes(buf[:got])

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        fetched = []
        for offset, length in runs:
            buf = bytearray(length)
            got = self._get([memoryview(buf)], offset)
            fetched.append((offset, memoryview(buf)[:got]))  # served without a copy
        self._runs = fetched

    def close(self) -> None:
        self._runs = []

    def __enter__(self) -> S3Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class S3Writer:
    """One object written at offsets from several threads, each byte once: bytes are
    gathered into parts of :data:`PART_BYTES`, and the thread whose write completes a
    part uploads it. :meth:`finish` uploads the rest (the first part, which holds a
    shard's checksum table, and the last) and completes the upload; an object of one
    part is one PUT."""

    def __init__(self, store: S3Store, key: str, size_hint: int | None, part_bytes: int) -> None:
        self._store = store
        self._key = key
        self.part_bytes = part_size(part_bytes, size_hint)
        self._lock = threading.Lock()
        self._buffers: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._etags: dict[int, str] = {}
        self._end = 0
        self._upload_id: str | None = None
        self._done = False

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        total = 0
        complete: list[int] = []
        for part, within, data in cut(buffers, offset, self.part_bytes):
            with self._lock:
                if self._done:
                    raise ValueError(f"{self._store.where(self._key)} is closed")
                buf = self._buffers.get(part)
                if buf is None:
                    if part in self._etags:
                        raise ValueError(f"part {part} of {self._key} written twice")
                    buf = self._buffers[part] = bytearray(self.part_bytes)
                    self._filled[part] = 0
            buf[within : within + data.nbytes] = data
            with self._lock:
                self._filled[part] += data.nbytes
                self._end = max(self._end, part * self.part_bytes + within + data.nbytes)
                if self._filled[part] == self.part_bytes:
                    complete.append(part)
            total += data.nbytes
        for part in complete:
            self._upload_part(part, self.part_bytes)
        return total

    def _start(self) -> str:
        with self._lock:
            if self._upload_id is None:
                response = self._store.request("upload", self._key, "create_multipart_upload")
                self._upload_id = str(response["UploadId"])
            return self._upload_id

    def _upload_part(self, part: int, length: int) -> None:
        upload = self._start()
        with self._lock:
            buf = self._buffers.pop(part, None)
            self._filled.pop(part, None)
        if buf is None:
            buf = bytearray(length)  # never written: a gap is zeros
        del buf[length:]  # in place: the body is the part's own buffer, not a copy
        body = buf
        response = self._store.request(
            "upload", self._key, "upload_part", UploadId=upload, PartNumber=part + 1, Body=body
        )
        with self._lock:
            self._etags[part] = str(response["ETag"])

    def finish(self, durable: bool = True) -> None:
        store = self._store
        try:
            with self._lock:
                end, started = self._end, self._upload_id is not None
            last = max(0, (end - 1) // self.part_bytes) if end else 0
            if not started and last == 0:
                body = self._buffers.get(0, bytearray())
                del body[end:]
                store.request("write", self._key, "put_object", Body=body)
                return
            for part in range(last + 1):
                if part not in self._etags:
                    length = self.part_bytes if part < last else end - last * self.part_bytes
                    self._upload_part(part, length)
            upload = self._start()
            etags = [self._etags[k] for k in range(last + 1)]
            parts = [{"PartNumber": k + 1, "ETag": e} for k, e in enumerate(etags)]

            def complete() -> None:
                try:
                    client().complete_multipart_upload(
                        Bucket=store.bucket,
                        Key=store._key(self._key),
                        UploadId=upload,
                        MultipartUpload={"Parts": parts},
                    )
                except Exception as exc:
                    # A retry after a lost answer finds the upload gone (NoSuchUpload):
                    # it completed if the object is the one these parts make.
                    if error_code(exc) != "NoSuchUpload" or not self._landed(etags, end):
                        raise

            store.call("upload", self._key, complete)
            self._upload_id = None
        except BaseException:
            self.abort()
            raise
        finally:
            with self._lock:
                self._done = True
                self._buffers.clear()

    def _landed(self, etags: builtins.list[str], size: int) -> bool:
        """Whether the object now holds exactly the parts with ``etags``, ``size`` bytes."""
        try:
            head = self._store.head(self._key)
        except FileNotFoundError:
            return False
        return int(head["ContentLength"]) == size and head["ETag"] == multipart_etag(etags)

    def abort(self) -> None:
        with self._lock:
            self._done = True
            self._buffers.clear()
            upload, self._upload_id = self._upload_id, None
        if upload is not None:
            try:
                self._store.request("abort", self._key, "abort_multipart_upload", UploadId=upload)
            except Exception as exc:  # gc aborts what is left
                log.debug("abort of %s failed: %s", self._store.where(self._key), exc)

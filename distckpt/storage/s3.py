"""The object-store backend of the storage seam: a prefix of an S3-compatible bucket
(Amazon S3, MinIO, Ceph RGW, ...), through boto3 (``pip install 'distckpt[s3]'``), made of
the primitives :class:`~distckpt.storage.object_store.ObjectStore` builds a store of.

Credentials, region and endpoint come from where every AWS tool finds them: the
``AWS_*`` environment variables (``AWS_ENDPOINT_URL`` for a non-AWS service, plain
``http://`` included), ``~/.aws/config`` and ``~/.aws/credentials``, or an instance role.
distckpt never logs them nor puts them in a message or the index.

* **Large objects** are multipart uploads whose parts (:data:`PART_BYTES`) are sent by
  the thread whose write completes them, so a save's I/O workers upload in parallel and
  in any order; an object that fits in one part is one PUT.
* **Reads** are ranged GETs;
  :meth:`~distckpt.storage.object_io.ObjectReader.will_need` fetches each run of
  adjacent inner chunks a task needs in one request.
* **Retries**: botocore's standard mode retries throttling, 5xx answers and dropped
  connections with exponential backoff, up to :data:`MAX_ATTEMPTS` tries (unless
  ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` say otherwise); a body cut off mid-read is
  retried here. A conditional write whose first try succeeded but whose answer was lost
  sees its own retry fail the condition: it then reads the object back, and identical
  bytes mean it was its own write.
* **Deadlines**: every request, its retries included, ends within :class:`Deadline`
  (``$DISTCKPT_S3_TIMEOUT``): socket time-outs cut a try that waits on a silent service,
  and no retry starts that could end after the deadline. A request that got no answer
  marks the service silent (:mod:`distckpt.storage.s3_service`): the requests in flight
  stop after their try, and every later one fails at once, until the service answers a
  probe again. A save, load or listing whose service stops answering thus raises
  :class:`~distckpt.errors.StorageError` within twice the deadline, on every rank.
* **Permanent failures** (no such bucket, access denied, no credentials, retries
  exhausted) raise :class:`~distckpt.errors.StorageError` naming the bucket, key and
  operation.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from distckpt import settings
from distckpt.errors import StorageError
from distckpt.storage.backend import Buffer, ConditionFailed, Store
from distckpt.storage.object_store import ObjectInfo, ObjectStore
from distckpt.storage.s3_service import (  # noqa: F401 - public names re-exported
    MAX_ATTEMPTS,
    TIMEOUT_ENV,
    Deadline,
    answering,
    back_off,
    body_retry,
    client,
    current_service,
    deadline,
    error_code,
    one_deadline,
    one_line,
    transient,
)

#: Bytes per part of a multipart upload (S3 needs at least 5 MiB but for the last).
PART_BYTES = settings.S3_PART_BYTES.value()
#: The largest object one CopyObject request copies (S3's limit); larger ones are copied
#: in parts of this size.
COPY_PART_BYTES = 5 << 30
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_CONDITION = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409"}
_PERMANENT = {
    "NoSuchBucket": "no such bucket",
    "AccessDenied": "access denied",
    "403": "access denied",
    "InvalidAccessKeyId": "the access key is not valid",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "ExpiredToken": "the credentials have expired",
    "InvalidBucketName": "not a valid bucket name",
}

T = TypeVar("T")


def multipart_etag(etags: Sequence[str]) -> str:
    """The ETag S3 gives the object a multipart upload of parts with ``etags`` makes: the
    MD5 of the parts' MD5s, then ``-`` and their count (not so under SSE-KMS: there the
    check fails, safely)."""
    digests = b"".join(bytes.fromhex(e.strip('"')) for e in etags)
    return f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"'


def _info(path: str, found: dict[str, Any], size: str) -> ObjectInfo:
    """An object as a HEAD (``size``: ``ContentLength``) or a listing (``Size``) tells it."""
    version = str(found.get("ETag", ""))
    return ObjectInfo(path, int(found[size]), found["LastModified"].timestamp(), version)


class S3Store(ObjectStore):
    """A prefix of an S3 bucket (``s3://bucket/prefix``)."""

    capabilities = replace(ObjectStore.capabilities, copies=True)
    uploads_parts = True

    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        super().__init__(f"s3://{bucket}", prefix)

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket named (use s3://bucket/prefix)")
        return cls(bucket, prefix)

    @property
    def part_bytes(self) -> int:
        return PART_BYTES

    def operation(self) -> contextlib.AbstractContextManager[Any]:
        return one_deadline()  # a conditional write and its read-back: one deadline

    # -- requests, with errors made ours --------------------------------------------

    def call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run requests (see :meth:`~distckpt.storage.object_io.Objects.call`); while the
        service is silent (see :mod:`distckpt.storage.s3_service`) fail at once, without
        a request."""
        service = current_service()
        if service.silent_since is not None:
            raise StorageError(
                f"{self.root}: {op} {self.address(path)} failed: the service is not "
                f"answering (an earlier request got no answer; {TIMEOUT_ENV} "
                f"{service.deadline.total:g} s); not waiting again until it answers"
            )
        return super().call(op, path, fn)

    def _s3(self, method: str, path: str, **kwargs: Any) -> Any:
        """``client().<method>(Bucket=, Key=path, ...)``: one request about one object."""
        return getattr(client(), method)(Bucket=self.bucket, Key=path, **kwargs)

    def request(self, op: str, path: str, method: str, **kwargs: Any) -> Any:
        """One request about the object at ``path`` (:meth:`_s3`) through :meth:`call`."""
        return self.call(op, path, lambda: self._s3(method, path, **kwargs))

    def translate(self, exc: Exception, op: str, path: str, waited: float) -> BaseException:
        if isinstance(exc, FileNotFoundError):
            return exc  # a nested request's: already ours
        if transient(exc):
            current_service().fell_silent(self.bucket)
        code = error_code(exc)
        where, failed = self.address(path), f"{self.root}: {op} {self.address(path)} failed"
        if code in _NOT_FOUND:
            return FileNotFoundError(f"{where} does not exist")
        if code in _CONDITION:
            return ConditionFailed(f"{where}: {op}: the condition failed")
        if code in _PERMANENT:
            return StorageError(f"{failed}: {_PERMANENT[code]}")
        name = type(exc).__name__
        if name == "NoCredentialsError":
            return StorageError(
                f"{self.root}: {op} failed: no AWS credentials found "
                "(set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
            )
        if code is not None:
            message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", ""))
            return StorageError(f"{failed}: {code} {message}".rstrip())
        if transient(exc):
            return StorageError(
                f"{failed}: no answer from the service in {waited:.1f} s ({name}: {one_line(exc)})"
            )
        return StorageError(f"{failed}: {name}: {one_line(exc)}")

    # -- the primitives -------------------------------------------------------------

    def get(self, path: str) -> tuple[bytes, str]:
        def get() -> tuple[bytes, str]:
            response = self._s3("get_object", path)
            return response["Body"].read(), str(response["ETag"])

        return body_retry(get)

    def get_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        last = offset + sum(b.nbytes for b in buffers) - 1

        def get() -> int:
            try:
                response = self._s3("get_object", path, Range=f"bytes={offset}-{last}")
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

        return body_retry(get)

    def put(
        self, path: str, data: Buffer, *, if_absent: bool = False, if_version: str | None = None
    ) -> str:
        body = data if isinstance(data, bytearray) else bytes(data)  # a part: not copied
        condition = {"IfNoneMatch": "*"} if if_absent else {}
        if if_version is not None:
            condition = {"IfMatch": if_version}
        with one_deadline() as start:
            for attempt in range(MAX_ATTEMPTS):
                try:
                    return str(self._s3("put_object", path, Body=body, **condition)["ETag"])
                except Exception as exc:
                    if (
                        not condition
                        or error_code(exc) not in _CONFLICT
                        or attempt + 1 == MAX_ATTEMPTS
                        or not current_service().may_retry(start)
                    ):
                        raise
                    back_off(attempt, start)  # a concurrent conditional write: try again
        raise AssertionError("unreachable")

    def head(self, path: str) -> ObjectInfo:
        return _info(path, self._s3("head_object", path), "ContentLength")

    def _pages(self, listing: str, prefix: str, **kwargs: Any) -> list[Any]:
        """Every page of the paginated ``listing`` of the objects under ``prefix``."""
        paginator = client().get_paginator(listing)
        return list(paginator.paginate(Bucket=self.bucket, Prefix=prefix, **kwargs))

    def scan(self, prefix: str, limit: int | None = None) -> list[ObjectInfo]:
        if limit is None:
            pages = self._pages("list_objects_v2", prefix)
        else:
            pages = [client().list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=limit)]
        return [_info(o["Key"], o, "Size") for page in pages for o in page.get("Contents", ())]

    def scan_level(self, prefix: str) -> list[str]:
        pages = self._pages("list_objects_v2", prefix, Delimiter="/")
        found = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", ())]
        return found + [o["Key"] for page in pages for o in page.get("Contents", ())]

    def remove(self, paths: Sequence[str]) -> None:
        if len(paths) == 1:
            self._s3("delete_object", paths[0])
            return
        objects = [{"Key": path} for path in paths]
        response = client().delete_objects(
            Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
        )
        errors = response.get("Errors") or []
        if errors:
            first = errors[0]
            raise StorageError(
                f"{self.root}: delete failed for {len(errors)} objects, first "
                f"{self.address(first.get('Key', ''))}: {first.get('Code')}"
            )

    def start_upload(self, path: str) -> str:
        return str(self._s3("create_multipart_upload", path)["UploadId"])

    def put_part(self, path: str, upload: str, number: int, body: bytearray) -> str:
        response = self._s3("upload_part", path, UploadId=upload, PartNumber=number, Body=body)
        return str(response["ETag"])

    def complete_upload(self, path: str, upload: str, tags: Sequence[str], size: int) -> None:
        parts = [{"PartNumber": k + 1, "ETag": tag} for k, tag in enumerate(tags)]
        try:
            self._s3(
                "complete_multipart_upload",
                path,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
            )
        except Exception as exc:
            # A retry after a lost answer finds the upload gone (NoSuchUpload): it
            # completed if the object is the one these parts make.
            if error_code(exc) != "NoSuchUpload" or not self.landed(path, tags, size):
                raise

    def landed(self, path: str, tags: Sequence[str], size: int) -> bool:
        """Whether the object at ``path`` holds exactly the parts with ``tags``, ``size``
        bytes (a multipart upload of them completed)."""
        try:
            found = self.call("stat", path, lambda: self.head(path))
        except FileNotFoundError:
            return False
        return found.size == size and found.version == multipart_etag(tags)

    def abort_upload(self, path: str, upload: str) -> None:
        self._s3("abort_multipart_upload", path, UploadId=upload)

    # -- beyond the primitives --------------------------------------------------------

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """A server-side copy of ``source_key`` of ``source`` (a prefix of this service),
        only of the version ``expect`` names when given: one request up to 5 GiB, else a
        multipart copy of :data:`COPY_PART_BYTES` parts."""
        if not isinstance(source, S3Store):
            raise TypeError(f"{self.url} copies from s3://, not from {source.url}")
        origin = {"Bucket": source.bucket, "Key": source.path_of(source_key)}
        found = source.stat(source_key)
        if expect is not None and found.version != expect:
            raise ConditionFailed(f"{source.where(source_key)} was written again since")
        path = self.path_of(key)
        condition = {} if expect is None else {"CopySourceIfMatch": expect}
        if found.size <= COPY_PART_BYTES:
            self.request("copy", path, "copy_object", CopySource=origin, **condition)
            return
        upload = self.request("copy", path, "create_multipart_upload")["UploadId"]
        try:
            tags = []
            for number, start in enumerate(range(0, found.size, COPY_PART_BYTES), 1):
                end = min(found.size, start + COPY_PART_BYTES) - 1
                got = self.request(
                    "copy",
                    path,
                    "upload_part_copy",
                    UploadId=upload,
                    PartNumber=number,
                    CopySource=origin,
                    CopySourceRange=f"bytes={start}-{end}",
                    **condition,
                )
                tags.append(got["CopyPartResult"]["ETag"])
            self.call("copy", path, lambda: self.complete_upload(path, upload, tags, found.size))
        except BaseException:
            with contextlib.suppress(Exception):
                self.request("abort", path, "abort_multipart_upload", UploadId=upload)
            raise

    def delete_tree(self, key: str = "") -> None:
        super().delete_tree(key)
        self.abort_uploads(key)

    def abort_uploads(self, key: str = "") -> None:
        """Abort the unfinished multipart uploads under ``key`` (a dead writer's parts)."""
        prefix, path = self._dir(key), self.path_of(key)
        pages = self.call(
            "abort uploads", path, lambda: self._pages("list_multipart_uploads", prefix)
        )
        for page in pages:
            for upload in page.get("Uploads", ()):
                self.call(
                    "abort uploads",
                    path,
                    lambda u=upload: self.abort_upload(u["Key"], u["UploadId"]),  # type: ignore[misc]
                )

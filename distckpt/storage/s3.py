"""The object-store backend of the storage seam: a prefix of an S3-compatible bucket
(Amazon S3, MinIO, Ceph RGW, ...), through boto3 (``pip install 'distckpt[s3]'``).

Credentials, region and endpoint come from where every AWS tool finds them: the
``AWS_*`` environment variables (``AWS_ENDPOINT_URL`` for a non-AWS service, plain
``http://`` included), ``~/.aws/config`` and ``~/.aws/credentials``, or an instance role.
distckpt never logs them nor puts them in a message or the index.

* **Large objects** are multipart uploads whose parts (:data:`PART_BYTES`) are sent by
  the thread whose write completes them, so a save's I/O workers upload in parallel and
  in any order; an object that fits in one part is one PUT.
* **Reads** are ranged GETs; :meth:`S3Reader.will_need` fetches each run of adjacent
  inner chunks a task needs in one request.
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

import builtins
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from distckpt.errors import StorageError, UnsafePathError
from distckpt.storage.backend import (
    Buffer,
    Capabilities,
    ConditionFailed,
    Store,
    check_key,
    join,
    own_write,
)
from distckpt.storage.s3_io import S3Reader, S3Writer, multipart_etag  # noqa: F401
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

log = logging.getLogger(__name__)

#: Bytes per part of a multipart upload (S3 needs at least 5 MiB but for the last).
PART_BYTES = int(os.environ.get("DISTCKPT_S3_PART_BYTES", 8 << 20))
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


class S3Store:
    """A prefix of an S3 bucket (``s3://bucket/prefix``)."""

    capabilities = Capabilities(
        conditional_create=True,
        conditional_update=True,
        ranged_reads=True,
        parallel_writes=True,
        copies=True,
    )
    commit_strategy = "claim"

    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        rest = url[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket named (use s3://bucket/prefix)")
        return cls(bucket, prefix)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, S3Store) and (other.bucket, other.prefix) == (
            self.bucket,
            self.prefix,
        )

    def __hash__(self) -> int:
        return hash((self.bucket, self.prefix))

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else self.bucket

    @property
    def parent(self) -> S3Store:
        return S3Store(self.bucket, self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "")

    def child(self, key: str) -> S3Store:
        return S3Store(self.bucket, self._key(key)) if key else self

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{join(self.prefix, key)}"

    def _key(self, key: str) -> str:
        # A key read from an index never leaves the prefix: no "..", no absolute key.
        return join(self.prefix, check_key(key))

    def _dir(self, key: str) -> str:
        full = self._key(key)
        return f"{full}/" if full else ""

    # -- requests, with errors made ours --------------------------------------------

    def call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request; map its failure to FileNotFoundError, ConditionFailed or
        StorageError (naming the bucket, key and ``op``). While the service is silent
        (see :mod:`distckpt.storage.s3_service`) it fails at once, without a request."""
        service = current_service()
        if service.silent_since is not None:
            raise StorageError(
                f"s3://{self.bucket}: {op} {self.where(key)} failed: the service is not "
                f"answering (an earlier request got no answer; {TIMEOUT_ENV} "
                f"{service.deadline.total:g} s); not waiting again until it answers"
            )
        start = time.monotonic()
        try:
            return fn()
        except (StorageError, ConditionFailed, FileNotFoundError, UnsafePathError):
            raise  # a nested request's, or a key refused before any request: already ours
        except Exception as exc:
            if transient(exc):
                service.fell_silent(self.bucket)
            raise self._translate(exc, op, key, time.monotonic() - start) from None

    def request(self, op: str, key: str, method: str, **kwargs: Any) -> Any:
        """One request about object ``key``: ``client().<method>(Bucket=, Key=, ...)``,
        its failure made ours (see :meth:`call`)."""
        return self.call(
            op,
            key,
            lambda: getattr(client(), method)(Bucket=self.bucket, Key=self._key(key), **kwargs),
        )

    def _translate(
        self, exc: BaseException, op: str, key: str, waited: float | None = None
    ) -> BaseException:
        code = error_code(exc)
        where = self.where(key)
        if code in _NOT_FOUND:
            return FileNotFoundError(f"{where} does not exist")
        if code in _CONDITION:
            return ConditionFailed(f"{where}: {op}: the condition failed")
        if code in _PERMANENT:
            return StorageError(f"s3://{self.bucket}: {op} {where} failed: {_PERMANENT[code]}")
        name = type(exc).__name__
        if name == "NoCredentialsError":
            return StorageError(
                f"s3://{self.bucket}: {op} failed: no AWS credentials found "
                "(set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
            )
        if code is not None:
            message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", ""))
            return StorageError(
                f"s3://{self.bucket}: {op} {where} failed: {code} {message}".rstrip()
            )
        if transient(exc) and waited is not None:
            return StorageError(
                f"s3://{self.bucket}: {op} {where} failed: no answer from the service in "
                f"{waited:.1f} s ({name}: {one_line(exc)})"
            )
        return StorageError(f"s3://{self.bucket}: {op} {where} failed: {name}: {one_line(exc)}")

    # -- the protocol -------------------------------------------------------------

    def read(self, key: str) -> bytes:
        return self.read_versioned(key)[0]

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        def get() -> tuple[bytes, str]:
            response = client().get_object(Bucket=self.bucket, Key=self._key(key))
            return response["Body"].read(), str(response["ETag"])

        return self.call("read", key, lambda: body_retry(get))

    def open(self, key: str, size: int | None = None) -> S3Reader:
        return S3Reader(self, key, size)

    def head(self, key: str) -> dict[str, Any]:
        return self.request("stat", key, "head_object")

    def write(self, key: str, data: Buffer) -> None:
        self.request("write", key, "put_object", Body=bytes(data))

    def create(self, key: str, size_hint: int | None = None) -> S3Writer:
        return S3Writer(self, key, size_hint, PART_BYTES)

    def put_new(self, key: str, data: Buffer) -> str:
        body = bytes(data)
        return self._conditional(key, body, {"IfNoneMatch": "*"}, "create")

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        return self._conditional(key, bytes(data), {"IfMatch": version}, "replace")

    def _conditional(self, key: str, body: bytes, condition: dict[str, str], op: str) -> str:
        with one_deadline() as start:

            def put() -> Any:
                for attempt in range(MAX_ATTEMPTS):
                    try:
                        return client().put_object(
                            Bucket=self.bucket, Key=self._key(key), Body=body, **condition
                        )
                    except Exception as exc:
                        if (
                            error_code(exc) not in _CONFLICT
                            or attempt + 1 == MAX_ATTEMPTS
                            or not current_service().may_retry(start)
                        ):
                            raise
                        back_off(attempt, start)  # a concurrent conditional write: try again
                raise AssertionError("unreachable")

            try:
                return str(self.call(op, key, put)["ETag"])
            except FileNotFoundError:
                if "IfMatch" not in condition:
                    raise
                # Replacing a version of an object that is gone: the condition failed
                # (as on a file system), whatever the service's answer (404 or 412).
                raise ConditionFailed(f"{self.where(key)}: {op}: it is gone") from None
            except ConditionFailed as error:
                return own_write(self, key, body, error)  # our earlier try may have landed

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except FileNotFoundError:
            return False
        return True

    def age(self, key: str) -> float:
        return time.time() - self.head(key)["LastModified"].timestamp()

    def _pages(self, op: str, key: str, listing: str, **kwargs: Any) -> builtins.list[Any]:
        """Every page of the paginated ``listing`` of the objects under ``key``."""
        paginator = client().get_paginator(listing)
        return self.call(
            op,
            key,
            lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self._dir(key), **kwargs)),
        )

    def list(self, key: str = "") -> builtins.list[str]:
        cut = len(self._dir(key))
        names: set[str] = set()
        for page in self._pages("list", key, "list_objects_v2", Delimiter="/"):
            names.update(p["Prefix"][cut:].rstrip("/") for p in page.get("CommonPrefixes", ()))
            names.update(o["Key"][cut:] for o in page.get("Contents", ()))
        names.discard("")
        return sorted(names)

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        """Every object under ``key``: (key relative to ``key``, size, modification time)."""
        cut = len(self._dir(key))
        return [
            (o["Key"][cut:], int(o["Size"]), o["LastModified"].timestamp())
            for page in self._pages("list", key, "list_objects_v2")
            for o in page.get("Contents", ())
        ]

    def is_dir(self, key: str) -> bool:
        prefix = self._dir(key)
        response = self.call(
            "list",
            key,
            lambda: client().list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1),
        )
        return bool(response.get("KeyCount", 0))

    def stamp(self, key: str) -> str | None:
        """The object's ETag."""
        return str(self.head(key)["ETag"])

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """A server-side copy of ``source_key`` of ``source`` (a prefix of this service),
        only of the version ``expect`` names when given: one request up to 5 GiB, else a
        multipart copy of :data:`COPY_PART_BYTES` parts."""
        if not isinstance(source, S3Store):
            raise TypeError(f"{self.url} copies from s3://, not from {source.url}")
        origin = {"Bucket": source.bucket, "Key": source._key(source_key)}
        head = source.head(source_key)
        if expect is not None and str(head["ETag"]) != expect:
            raise ConditionFailed(f"{source.where(source_key)} was written again since")
        size = int(head["ContentLength"])
        condition = {} if expect is None else {"CopySourceIfMatch": expect}
        if size <= COPY_PART_BYTES:
            self.request("copy", key, "copy_object", CopySource=origin, **condition)
            return
        upload = self.request("copy", key, "create_multipart_upload")["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, COPY_PART_BYTES), 1):
                end = min(size, start + COPY_PART_BYTES) - 1
                got = self.request(
                    "copy",
                    key,
                    "upload_part_copy",
                    UploadId=upload,
                    PartNumber=number,
                    CopySource=origin,
                    CopySourceRange=f"bytes={start}-{end}",
                    **condition,
                )
                parts.append({"PartNumber": number, "ETag": got["CopyPartResult"]["ETag"]})
            self.request(
                "copy",
                key,
                "complete_multipart_upload",
                UploadId=upload,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self.request("abort", key, "abort_multipart_upload", UploadId=upload)
            raise

    def delete(self, key: str) -> None:
        self.request("delete", key, "delete_object")

    def delete_tree(self, key: str = "") -> None:
        keys = [join(self._dir(key), k) for k, _, _ in self.walk(key)]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            response = self.call(
                "delete",
                key,
                lambda b=batch: client().delete_objects(  # type: ignore[misc]
                    Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"s3://{self.bucket}: delete {self.where(key)} failed for "
                    f"{len(errors)} objects, first {first.get('Key')}: {first.get('Code')}"
                )
        self.abort_uploads(key)

    def abort_uploads(self, key: str = "") -> None:
        """Abort the unfinished multipart uploads under ``key`` (a dead writer's parts)."""
        for page in self._pages("abort uploads", key, "list_multipart_uploads"):
            for upload in page.get("Uploads", ()):
                self.call(
                    "abort uploads",
                    key,
                    lambda u=upload: client().abort_multipart_upload(  # type: ignore[misc]
                        Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                    ),
                )

    def prepare(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # an object store has no directories: only the keys to check

    def persist(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # a finished upload is durable: only the keys to check

"""Azure Blob Storage (``az://container/prefix``) and Google Cloud Storage
(``gs://bucket/prefix``), through obstore (``pip install 'distckpt[cloud]'``), the Python
binding of the Rust ``object_store`` crate: one client for both, with conditional puts,
parallel multipart uploads and concurrent ranged reads.

Credentials and endpoints come from where each vendor's tools find them, read by
obstore from the environment: ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY`` (or a SAS token, a service principal, a managed identity;
``AZURE_STORAGE_USE_EMULATOR=true`` and ``AZURITE_BLOB_STORAGE_URL`` for Azurite), and
``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_APPLICATION_CREDENTIALS`` (or the metadata server of
a cloud VM). distckpt never logs them nor puts them in a message or the index.

What each operation is, and what it guarantees (the same as ``s3://``):

* **Commit**: the claim strategy (:mod:`distckpt.commit.claim`). ``put_new`` is a
  create-only put (Azure ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), ``put_if`` a
  put on the version read (the ETag on Azure, the generation on GCS): exactly one of
  racing writers wins each. A conditional put whose answer was lost and whose retry then
  fails the condition reads the object back: identical bytes were its own write.
* **Writes** at any offset, from several threads: an object is gathered in memory in
  parts and uploaded when it is finished (a shard's checksum table, at its start, is its
  last write), as one put or, above one part, a multipart upload of
  :data:`~distckpt.storage.cloud_io.UPLOAD_CONCURRENCY` parts at a time. An unfinished
  upload leaves uncommitted blocks (Azure) or parts (GCS) that the service drops after
  a week or that a lifecycle rule removes; ``gc`` cannot list them through this client.
* **Reads** are ranged; :meth:`CloudReader.will_need` fetches a task's runs concurrently
  in one call.
* **Copies** (incremental saves) are server-side copies within a bucket; the source's
  version is checked before and after, so a copy of an object written again meanwhile
  fails and the piece is written instead.
* **Deadlines and retries**: obstore retries throttling, 5xx answers and dropped
  connections with exponential backoff, up to :data:`~distckpt.storage.s3_service.MAX_ATTEMPTS`
  tries and within ``$DISTCKPT_S3_TIMEOUT`` (the deadline of every object store's
  requests, see :func:`~distckpt.storage.s3_service.deadline`); a try that waits on a
  silent service is cut by the connect and request time-outs it derives.
* **Failures** raise :class:`~distckpt.errors.StorageError` naming the location and the
  operation; a missing object is ``FileNotFoundError``.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from distckpt.errors import StorageError, UnsafePathError
from distckpt.storage.backend import (
    Buffer,
    Capabilities,
    ConditionFailed,
    Store,
    byte_view,
    check_key,
    join,
    own_write,
)
from distckpt.storage.cloud_io import CloudReader, CloudWriter
from distckpt.storage.s3_service import MAX_ATTEMPTS, deadline

T = TypeVar("T")

#: Bytes per part of a multipart upload (Azure blocks and GCS parts; 5 MiB at least).
PART_BYTES = int(os.environ.get("DISTCKPT_CLOUD_PART_BYTES", 8 << 20))
#: Set to 1 to let a service be reached over plain ``http://`` (an emulator on loopback).
ALLOW_HTTP_ENV = "DISTCKPT_CLOUD_ALLOW_HTTP"
#: The services, by URL scheme: obstore's store class and what the URL names.
#: (``s3`` is obstore's S3 client, which benchmarks/bench_s3.py compares with boto3's;
#: ``s3://`` locations open :class:`~distckpt.storage.s3.S3Store`.)
SERVICES = {
    "az": ("AzureStore", "container"),
    "gs": ("GCSStore", "bucket"),
    "s3": ("S3Store", "bucket"),
}

#: The environment variables a client is made from (a change makes a new client).
_SETTINGS = ("AZURE_", "AZURITE_", "GOOGLE_", "AWS_", "DISTCKPT_")
_clients: dict[tuple[Any, ...], Any] = {}
_first_pid: int | None = None
_clients_lock = threading.Lock()


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise StorageError(
            "az:// and gs:// locations need obstore: pip install 'distckpt[cloud]'"
        ) from None
    return obstore


def _client(scheme: str, bucket: str) -> Any:
    """This process's obstore client of ``bucket``, made once for the settings in the
    environment. A process forked from one that used a client fails at once."""
    global _first_pid
    if _first_pid is None:
        _first_pid = os.getpid()
    elif _first_pid != os.getpid():
        # obstore's runtime does not survive a fork: a request would hang forever.
        raise StorageError(
            f"{scheme}://{bucket}: this process was forked from one that had used "
            f"{scheme}:// locations, which obstore cannot do; start it with the 'spawn' "
            "or 'forkserver' method of multiprocessing instead"
        )
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS)))
    key = (scheme, bucket, settings)
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            from obstore import store as stores

            limits = deadline()
            cls = getattr(stores, SERVICES[scheme][0])
            options = {
                "connect_timeout": f"{limits.connect:g}s",
                "timeout": f"{limits.connect + limits.read:g}s",
            }
            if os.environ.get(ALLOW_HTTP_ENV, "").lower() in {"1", "true"}:
                options["allow_http"] = "true"
            found = _clients[key] = cls(
                bucket,
                client_options=options,
                retry_config={
                    "max_retries": MAX_ATTEMPTS - 1,
                    "retry_timeout": timedelta(seconds=limits.total),
                },
            )
        return found


def _version(meta: Any) -> str:
    """The version token ``put_if`` takes: the ETag, and the generation where the service
    has one (GCS)."""
    e_tag, version = meta.get("e_tag"), meta.get("version")
    return str(e_tag) if version is None else json.dumps([e_tag, version])


def _update_mode(version: str) -> dict[str, Any]:
    if version.startswith("["):
        e_tag, number = json.loads(version)
        return {"e_tag": e_tag, "version": number}
    return {"e_tag": version}


class CloudStore:
    """A prefix of an Azure Blob container (``az://``) or a GCS bucket (``gs://``)."""

    capabilities = Capabilities(
        conditional_create=True,
        conditional_update=True,
        ranged_reads=True,
        parallel_writes=True,
        copies=True,
    )
    commit_strategy = "claim"

    def __init__(self, scheme: str, bucket: str, prefix: str = "") -> None:
        if scheme not in SERVICES:
            raise ValueError(f"{scheme}:// is not a cloud store (known: az://, gs://)")
        self.scheme = scheme
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        root = f"{scheme}://{bucket}"
        self.url = f"{root}/{self.prefix}" if self.prefix else root

    @classmethod
    def from_url(cls, url: str) -> CloudStore:
        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            what = SERVICES.get(scheme, ("", "bucket"))[1]
            raise ValueError(f"{url}: no {what} named (use {scheme}://{what}/prefix)")
        return cls(scheme, bucket, prefix)

    def __repr__(self) -> str:
        return f"CloudStore({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CloudStore) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] if self.prefix else self.bucket

    @property
    def parent(self) -> CloudStore:
        up = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else ""
        return CloudStore(self.scheme, self.bucket, up)

    def child(self, key: str) -> CloudStore:
        return CloudStore(self.scheme, self.bucket, self._key(key)) if key else self

    def where(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{join(self.prefix, key)}"

    def _key(self, key: str) -> str:
        # A key read from an index never leaves the prefix: no "..", no absolute key.
        return join(self.prefix, check_key(key))

    def _dir(self, key: str) -> str:
        full = self._key(key)
        return f"{full}/" if full else ""

    # -- requests, with errors made ours --------------------------------------------

    def call(self, op: str, key: str, fn: Callable[[Any, Any], T]) -> T:
        """``fn(obstore, client)``, its failure mapped to FileNotFoundError,
        ConditionFailed or StorageError naming the location and ``op``."""
        obstore = _obstore()
        start = time.monotonic()
        try:
            return fn(obstore, _client(self.scheme, self.bucket))
        except (StorageError, ConditionFailed, UnsafePathError):
            raise
        except Exception as exc:
            raise self._translate(exc, op, key, time.monotonic() - start) from None

    def _translate(self, exc: BaseException, op: str, key: str, waited: float) -> BaseException:
        where = self.where(key)
        name = type(exc).__name__
        if isinstance(exc, FileNotFoundError) or name == "NotFoundError":
            return FileNotFoundError(f"{where} does not exist")
        if name in {"AlreadyExistsError", "PreconditionError"}:
            return ConditionFailed(f"{where}: {op}: the condition failed")
        root = f"{self.scheme}://{self.bucket}"
        if name == "PermissionDeniedError":
            return StorageError(f"{root}: {op} {where} failed: access denied")
        if name == "UnauthenticatedError":
            return StorageError(
                f"{root}: {op} {where} failed: not authenticated (see the credentials "
                "the README's section on object stores names)"
            )
        said = " ".join(str(exc).split("\n\nDebug source")[0].split())[:300]  # not the dump
        return StorageError(f"{root}: {op} {where} failed after {waited:.1f} s: {said}")

    def head(self, key: str) -> dict[str, Any]:
        """The object's ``size``, ``e_tag``, ``version`` and ``last_modified``."""
        return dict(self.call("stat", key, lambda o, c: o.head(c, self._key(key))))

    # -- the protocol -------------------------------------------------------------

    def read(self, key: str) -> bytes:
        return self.read_versioned(key)[0]

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        def get(o: Any, c: Any) -> tuple[bytes, str]:
            result = o.get(c, self._key(key))
            return bytes(result.bytes()), _version(result.meta)

        return self.call("read", key, get)

    def open(self, key: str, size: int | None = None) -> CloudReader:
        return CloudReader(self, key, size)

    def write(self, key: str, data: Buffer) -> None:
        body = byte_view(data)
        self.call("write", key, lambda o, c: o.put(c, self._key(key), body))

    def create(self, key: str, size_hint: int | None = None) -> CloudWriter:
        return CloudWriter(self, key, size_hint, PART_BYTES)

    def put_new(self, key: str, data: Buffer) -> str:
        return self._conditional(key, bytes(data), "create", "create")

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        try:
            return self._conditional(key, bytes(data), _update_mode(version), "replace")
        except FileNotFoundError:
            # Replacing a version of an object that is gone: the condition failed.
            raise ConditionFailed(f"{self.where(key)}: replace: it is gone") from None

    def _conditional(self, key: str, body: bytes, mode: Any, op: str) -> str:
        try:
            return self.call(
                op, key, lambda o, c: _version(o.put(c, self._key(key), body, mode=mode))
            )
        except ConditionFailed as error:
            return own_write(self, key, body, error)  # our earlier try may have landed

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except FileNotFoundError:
            return False
        return True

    def age(self, key: str) -> float:
        return time.time() - self.head(key)["last_modified"].timestamp()

    def _objects(self, op: str, key: str) -> builtins.list[dict[str, Any]]:
        prefix = self._dir(key)
        return self.call(
            op,
            key,
            lambda o, c: [m for batch in o.list(c, prefix or None) for m in batch],
        )

    def list(self, key: str = "") -> builtins.list[str]:
        prefix = self._dir(key)
        found = self.call("list", key, lambda o, c: o.list_with_delimiter(c, prefix or None))
        cut = len(prefix)
        names = {p[cut:].rstrip("/") for p in found["common_prefixes"]}
        names.update(m["path"][cut:] for m in found["objects"])
        names.discard("")
        return sorted(names)

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        """Every object under ``key``: (key relative to ``key``, size, modification time)."""
        cut = len(self._dir(key))
        return [
            (m["path"][cut:], int(m["size"]), m["last_modified"].timestamp())
            for m in self._objects("list", key)
        ]

    def is_dir(self, key: str) -> bool:
        prefix = self._dir(key)

        def first(o: Any, c: Any) -> bool:
            for batch in o.list(c, prefix or None, chunk_size=1):
                return bool(batch)
            return False

        return self.call("list", key, first)

    def stamp(self, key: str) -> str | None:
        """The object's version (see :meth:`put_if`)."""
        return _version(self.head(key))

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """A server-side copy of ``source_key`` of ``source`` (a prefix of the same
        bucket), only of the version ``expect`` names when given: the source's version is
        read before and after the copy."""
        if not (
            isinstance(source, CloudStore)
            and (source.scheme, source.bucket) == (self.scheme, self.bucket)
        ):
            raise TypeError(f"{self.url} copies within its bucket, not from {source.url}")
        before = source.stamp(source_key)
        if expect is not None and before != expect:
            raise ConditionFailed(f"{source.where(source_key)} was written again since")
        origin = source._key(source_key)
        self.call("copy", key, lambda o, c: o.copy(c, origin, self._key(key)))
        if source.stamp(source_key) != before:
            self.delete(key)
            raise ConditionFailed(f"{source.where(source_key)} was written during the copy")

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # absent: nothing to do
            self.call("delete", key, lambda o, c: o.delete(c, self._key(key)))

    def delete_tree(self, key: str = "") -> None:
        paths = [m["path"] for m in self._objects("delete", key)]
        for start in range(0, len(paths), 256):
            batch = paths[start : start + 256]
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                self.call("delete", key, lambda o, c, b=batch: o.delete(c, b))  # type: ignore[misc]

    def prepare(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # an object store has no directories: only the keys to check

    def persist(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # a finished upload is durable: only the keys to check

"""Azure Blob Storage (``az://container/prefix``) and Google Cloud Storage
(``gs://bucket/prefix``), through obstore (``pip install 'distckpt[cloud]'``), the Python
binding of the Rust ``object_store`` crate: one client for both, with conditional puts,
parallel multipart uploads and concurrent ranged reads, made into a store by
:class:`~distckpt.storage.object_store.ObjectStore`.

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
  :data:`UPLOAD_CONCURRENCY` parts at a time. An unfinished
  upload leaves uncommitted blocks (Azure) or parts (GCS) that the service drops after
  a week or that a lifecycle rule removes; ``gc`` cannot list them through this client.
* **Reads** are ranged;
  :meth:`~distckpt.storage.object_io.ObjectReader.will_need` fetches a task's runs
  concurrently in one call.
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

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from itertools import islice
from typing import Any

from distckpt import settings
from distckpt.errors import StorageError
from distckpt.storage.backend import Buffer, ConditionFailed, Store, byte_view
from distckpt.storage.object_io import fill
from distckpt.storage.object_store import ObjectInfo, ObjectStore
from distckpt.storage.s3_service import MAX_ATTEMPTS, deadline

#: Bytes per part of a multipart upload (Azure blocks and GCS parts; 5 MiB at least).
PART_BYTES = settings.CLOUD_PART_BYTES.value()
#: Parts of one object uploaded at once.
UPLOAD_CONCURRENCY = 8
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
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS)))
    key = (scheme, bucket, environment)
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
            if settings.CLOUD_ALLOW_HTTP.value():
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


def _info(meta: Any) -> ObjectInfo:
    return ObjectInfo(
        str(meta["path"]), int(meta["size"]), meta["last_modified"].timestamp(), _version(meta)
    )


def _update_mode(version: str) -> dict[str, Any]:
    if version.startswith("["):
        e_tag, number = json.loads(version)
        return {"e_tag": e_tag, "version": number}
    return {"e_tag": version}


class CloudStore(ObjectStore):
    """A prefix of an Azure Blob container (``az://``) or a GCS bucket (``gs://``)."""

    capabilities = replace(ObjectStore.capabilities, copies=True)
    # obstore refuses a range that starts at or past the end (the reader cuts ranges).
    reads_past_end = False
    remove_batch = 256

    def __init__(self, scheme: str, bucket: str, prefix: str = "") -> None:
        if scheme not in SERVICES:
            raise ValueError(f"{scheme}:// is not a cloud store (known: az://, gs://)")
        self.scheme = scheme
        self.bucket = bucket
        super().__init__(f"{scheme}://{bucket}", prefix)

    @classmethod
    def from_url(cls, url: str) -> CloudStore:
        scheme, _, rest = url.partition("://")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            what = SERVICES.get(scheme, ("", "bucket"))[1]
            raise ValueError(f"{url}: no {what} named (use {scheme}://{what}/prefix)")
        return cls(scheme, bucket, prefix)

    @property
    def part_bytes(self) -> int:
        return PART_BYTES

    def _service(self) -> tuple[Any, Any]:
        """obstore, and this process's client of the bucket."""
        return _obstore(), _client(self.scheme, self.bucket)

    def translate(self, exc: Exception, op: str, path: str, waited: float) -> BaseException:
        where = self.address(path)
        name = type(exc).__name__
        if isinstance(exc, FileNotFoundError) or name == "NotFoundError":
            return FileNotFoundError(f"{where} does not exist")
        if name in {"AlreadyExistsError", "PreconditionError"}:
            return ConditionFailed(f"{where}: {op}: the condition failed")
        failed = f"{self.root}: {op} {where} failed"
        if name == "PermissionDeniedError":
            return StorageError(f"{failed}: access denied")
        if name == "UnauthenticatedError":
            return StorageError(
                f"{failed}: not authenticated (Azure: AZURE_STORAGE_ACCOUNT_NAME with "
                "AZURE_STORAGE_ACCOUNT_KEY, a SAS token or an identity; GCS: "
                "GOOGLE_APPLICATION_CREDENTIALS or a VM's metadata server)"
            )
        said = " ".join(str(exc).split("\n\nDebug source")[0].split())[:300]  # not the dump
        return StorageError(f"{failed} after {waited:.1f} s: {said}")

    # -- the primitives -------------------------------------------------------------

    def get(self, path: str) -> tuple[bytes, str]:
        o, c = self._service()
        result = o.get(c, path)
        return bytes(result.bytes()), _version(result.meta)

    def get_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        o, c = self._service()
        length = sum(b.nbytes for b in buffers)
        return fill(buffers, memoryview(o.get_range(c, path, start=offset, length=length)))

    def get_runs(self, path: str, runs: Sequence[tuple[int, int]]) -> list[Buffer]:
        o, c = self._service()
        starts, lengths = [start for start, _ in runs], [length for _, length in runs]
        return list(o.get_ranges(c, path, starts=starts, lengths=lengths))

    def put(
        self, path: str, data: Buffer, *, if_absent: bool = False, if_version: str | None = None
    ) -> str:
        o, c = self._service()
        mode: Any = "create" if if_absent else "overwrite"
        if if_version is not None:
            mode = _update_mode(if_version)
        return _version(o.put(c, path, byte_view(data), mode=mode))

    def put_parts(self, path: str, parts: Sequence[bytearray]) -> None:
        o, c = self._service()
        o.put(c, path, list(parts), chunk_size=len(parts[0]), max_concurrency=UPLOAD_CONCURRENCY)

    def head(self, path: str) -> ObjectInfo:
        o, c = self._service()
        return _info(o.head(c, path))

    def scan(self, prefix: str, limit: int | None = None) -> list[ObjectInfo]:
        o, c = self._service()
        batches = o.list(c, prefix or None, chunk_size=limit or 50)
        return [_info(meta) for batch in islice(batches, 1 if limit else None) for meta in batch]

    def scan_level(self, prefix: str) -> list[str]:
        o, c = self._service()
        found = o.list_with_delimiter(c, prefix or None)
        return [*found["common_prefixes"], *(meta["path"] for meta in found["objects"])]

    def remove(self, paths: Sequence[str]) -> None:
        o, c = self._service()
        o.delete(c, paths[0] if len(paths) == 1 else list(paths))

    # -- beyond the primitives --------------------------------------------------------

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
        origin, path = source.path_of(source_key), self.path_of(key)
        o, c = self._service()
        self.call("copy", path, lambda: o.copy(c, origin, path))
        if source.stamp(source_key) != before:
            self.delete(key)
            raise ConditionFailed(f"{source.where(source_key)} was written during the copy")

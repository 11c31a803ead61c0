"""The base of the stores over a flat key space: S3, Azure and GCS
(:mod:`distckpt.storage.s3`, :mod:`distckpt.storage.cloud`), and any plug-in that keeps
its objects under keys, a file system used as one included.

A subclass of :class:`ObjectStore` implements the primitives of
:class:`~distckpt.storage.object_io.Objects` (``get``, ``get_into``, ``put``, ``head``,
``scan``, ``remove``; the others where its service does better than their defaults);
:class:`ObjectStore` makes the whole :class:`~distckpt.storage.backend.Store` protocol of
them, keeping the rules that protocol states:

* **Naming.** A store is a ``root`` (``s3://bucket``: the URL of the whole key space)
  and a ``prefix`` in it; ``url`` is ``root/prefix`` (``root`` alone for the empty
  prefix). ``child(key)`` is the store at ``prefix/key``, so its URL is
  ``url + "/" + key``; ``parent`` drops the last component (the root's parent is the
  root); ``name`` is the last component (the root's own last component at the root);
  ``where(key)`` is ``url + "/" + key``. Stores are equal, and hash alike, when they are
  of the same class at the same URL.
* **Keys** pass :func:`~distckpt.storage.backend.check_key` in every method, before a
  request: a key that leads outside the store is an
  :class:`~distckpt.errors.UnsafePathError`.
* **Prefixes.** There are no directories, only keys with ``/``: a prefix exists while an
  object is under it. ``exists(key)`` is true of an object or of such a prefix,
  ``is_dir`` of the prefix only; ``age`` of a prefix is that of the newest object under
  it; ``list`` names the objects and prefixes directly under a key, sorted, without
  repeats; ``delete_tree`` removes every object under a key (not one at the key itself).
* **Conditional writes** are one primitive, :meth:`Objects.put` with a condition:
  ``put_new`` creates only what is absent, ``put_if`` replaces only the version read
  (one that is gone fails the condition too). A condition that fails where the object
  now holds exactly the bytes being written counts as a success, with the version they
  have: the retry of a write whose first try landed and whose answer was lost.
* **Handles**: :meth:`~ObjectStore.open` gives an
  :class:`~distckpt.storage.object_io.ObjectReader`, :meth:`~ObjectStore.create` an
  :class:`~distckpt.storage.object_io.ObjectWriter`.
* **Configuration** comes from the URL and the environment, never from the process that
  made the store: :func:`~distckpt.storage.registry.open_store` opens ``url`` again on
  every rank, and in the forked processes of the conformance suite's races. A client
  made in one process is never used in another (keep clients per process id).

It declares what the primitives give (:attr:`~ObjectStore.capabilities`: conditional
creates and updates, ranged reads, parallel writes) and commits by claim; a subclass adds
``copies`` with a ``copy`` of its own (:class:`~distckpt.storage.backend.CopyingStore`).

Writing one: ``__init__`` calls ``super().__init__(root, prefix)``, and a ``from_url``
classmethod parses the URL (the opener the registry calls; a :class:`ValueError` for
one it cannot parse). Then the six primitives; where the service does better,
``scan_level`` (a listing with a delimiter), ``get_runs`` (ranges in one request),
``put_parts`` or multipart uploads (:attr:`~distckpt.storage.object_io.Objects.uploads_parts`),
and ``translate`` to turn the client's errors into ``FileNotFoundError``,
``ConditionFailed`` and :class:`~distckpt.errors.StorageError`. The ``files://``
plug-in of the documentation (docs/storage/plugins.md) is a whole one, in under a hundred
lines::

    class FilesStore(ObjectStore):
        def __init__(self, path):
            super().__init__("files://", os.path.abspath(path))

        def get(self, path):
            data = Path("/" + path).read_bytes()
            return data, hashlib.sha256(data).hexdigest()
        ...
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import time
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

from distckpt.storage.backend import (
    Buffer,
    Capabilities,
    ConditionFailed,
    check_key,
    join,
    own_write,
)
from distckpt.storage.object_io import ObjectInfo, ObjectReader, Objects, ObjectWriter
from distckpt.storage.parts import part_size

if TYPE_CHECKING:
    from typing import Self

__all__ = ["ObjectInfo", "ObjectStore"]


class ObjectStore(Objects):
    """A prefix of a flat key space: the :class:`~distckpt.storage.backend.Store`
    protocol made of the primitives of :class:`~distckpt.storage.object_io.Objects` (see
    the module for the rules it keeps). ``root`` is the URL of the whole key space
    (``s3://bucket``), ``prefix`` where in it the store is; the primitives see full
    paths, ``prefix/key``."""

    capabilities = Capabilities(
        conditional_create=True, conditional_update=True, ranged_reads=True, parallel_writes=True
    )
    commit_strategy = "claim"

    def __init__(self, root: str, prefix: str = "") -> None:
        self.root = root
        self.prefix = prefix.strip("/")
        self.url = f"{root}/{self.prefix}" if self.prefix else root

    def at(self, prefix: str) -> Self:
        """The store at ``prefix`` of the same key space (:meth:`child` and :meth:`parent`
        use it): a copy of this one with ``prefix`` and ``url`` replaced. A subclass
        that keeps anything else derived from its prefix overrides it."""
        other = copy.copy(self)
        ObjectStore.__init__(other, self.root, prefix)
        return other

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ObjectStore) and type(other) is type(self) and other.url == self.url
        )

    def __hash__(self) -> int:
        return hash((type(self), self.url))

    @property
    def name(self) -> str:
        return (self.prefix or self.root).rsplit("/", 1)[-1]

    @property
    def parent(self) -> Self:
        return self.at(self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "")

    def child(self, key: str) -> Self:
        return self.at(self.path_of(key)) if key else self

    def where(self, key: str) -> str:
        return self.address(join(self.prefix, key))

    def address(self, path: str) -> str:
        """The display form of a full ``path`` (for messages)."""
        return f"{self.root}/{path}" if path else self.root

    def path_of(self, key: str) -> str:
        """The full path of ``key``, checked first (a key read from an index never leaves
        the prefix: no ``..``, no absolute key)."""
        return join(self.prefix, check_key(key))

    def _dir(self, key: str) -> str:
        path = self.path_of(key)
        return f"{path}/" if path else ""

    def operation(self) -> contextlib.AbstractContextManager[Any]:
        """A context around the requests of one operation (a conditional write and its
        read-back); S3 gives them one deadline. Default: nothing."""
        return contextlib.nullcontext()

    # -- objects ----------------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo:
        """The object at ``key`` (:class:`FileNotFoundError` if there is none)."""
        path = self.path_of(key)
        return self.call("stat", path, lambda: self.head(path))

    def stamp(self, key: str) -> str | None:
        """The object's version (see :class:`~distckpt.storage.backend.CopyingStore`)."""
        return self.stat(key).version

    def read(self, key: str) -> bytes:
        return self.read_versioned(key)[0]

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        path = self.path_of(key)
        return self.call("read", path, lambda: self.get(path))

    def open(self, key: str, size: int | None = None) -> ObjectReader:
        return ObjectReader(self, self.path_of(key), size)

    def write(self, key: str, data: Buffer) -> None:
        path = self.path_of(key)
        self.call("write", path, lambda: self.put(path, data))

    def create(self, key: str, size_hint: int | None = None) -> ObjectWriter:
        return ObjectWriter(
            self, self.path_of(key), self.where(key), part_size(self.part_bytes, size_hint)
        )

    def put_new(self, key: str, data: Buffer) -> str:
        return self._conditional(key, data, None)

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        return self._conditional(key, data, version)

    def _conditional(self, key: str, data: Buffer, version: str | None) -> str:
        path, body = self.path_of(key), bytes(data)
        op, absent = ("create", True) if version is None else ("replace", False)
        with self.operation():
            try:
                return self.call(
                    op, path, lambda: self.put(path, body, if_absent=absent, if_version=version)
                )
            except FileNotFoundError:
                if absent:
                    raise
                # Replacing a version of an object that is gone: the condition failed
                # (as on a file system), whatever the service's answer.
                raise ConditionFailed(f"{self.where(key)}: {op}: it is gone") from None
            except ConditionFailed as error:
                return own_write(self, key, body, error)  # our earlier try may have landed

    def delete(self, key: str) -> None:
        path = self.path_of(key)
        with contextlib.suppress(FileNotFoundError):  # absent: nothing to do
            self.call("delete", path, lambda: self.remove([path]))

    # -- prefixes -----------------------------------------------------------------------

    def _scan(self, key: str, limit: int | None = None) -> builtins.list[ObjectInfo]:
        prefix = self._dir(key)
        return self.call(
            "list", self.path_of(key), lambda: list(islice(self.scan(prefix, limit), limit))
        )

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except FileNotFoundError:
            return self.is_dir(key)
        return True

    def is_dir(self, key: str) -> bool:
        return bool(self._scan(key, 1))

    def age(self, key: str) -> float:
        try:
            modified = self.stat(key).modified
        except FileNotFoundError:
            below = self._scan(key)  # a prefix: as old as its newest object
            if not below:
                raise
            modified = max(found.modified for found in below)
        return time.time() - modified

    def list(self, key: str = "") -> builtins.list[str]:
        prefix = self._dir(key)
        paths = self.call("list", self.path_of(key), lambda: list(self.scan_level(prefix)))
        names = {path[len(prefix) :].rstrip("/") for path in paths}
        names.discard("")
        return sorted(names)

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        cut = len(self._dir(key))
        return [(found.path[cut:], found.size, found.modified) for found in self._scan(key)]

    def delete_tree(self, key: str = "") -> None:
        paths = [found.path for found in self._scan(key)]
        for start in range(0, len(paths), self.remove_batch):
            batch = paths[start : start + self.remove_batch]
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                self.call("delete", self.path_of(key), lambda b=batch: self.remove(b))  # type: ignore[misc]

    def prepare(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # an object store has no directories: only the keys to check

    def persist(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)  # a finished put is durable: only the keys to check

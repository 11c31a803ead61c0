"""The storage seam: one small protocol for every place a checkpoint can live.

A :class:`Store` is a directory of a file system (:mod:`distckpt.storage.posix`) or a
prefix of an object store (:mod:`distckpt.storage.s3`). Keys are relative to it and use
``/``. The engine, the manager and the CLI reach storage only through it; the
training-state layer never does.

What every backend provides, and who calls it during a save (``rank 0`` is the
coordinator):

1. rank 0: :meth:`Store.read` / :meth:`Store.list` / :meth:`Store.exists` to check the
   name is free, then begins the save's transaction (:mod:`distckpt.storage.transaction`);
2. every rank: :meth:`Store.prepare` for the keys it will write, :meth:`Store.create` for
   each piece (written at offsets, from several threads, then :meth:`WriteHandle.finish`),
   :meth:`Store.write` for small objects, :meth:`Store.persist` once all are finished;
3. rank 0: the commit primitives, :meth:`Store.put_new` (create only if absent) and
   :meth:`Store.put_if` (replace only the version read, from
   :meth:`Store.read_versioned`), and :meth:`Store.delete` / :meth:`Store.delete_tree`.

A load uses :meth:`Store.open` (ranged reads; :meth:`ReadHandle.will_need` says which
ranges come next, so an object store fetches each run once).

Errors: a missing key is :class:`FileNotFoundError`; a failed condition is
:class:`ConditionFailed` (a :class:`FileExistsError`); a permanent service failure (no
such bucket, access denied, retries exhausted) is :class:`~distckpt.errors.StorageError`,
naming the location and the operation, never a credential.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from distckpt.errors import ConditionFailed as ConditionFailed  # the seam's own error
from distckpt.errors import UnsafePathError

Buffer = Any  # anything with the buffer protocol: bytes, bytearray, memoryview, ndarray


def byte_view(data: Buffer) -> memoryview:
    """A flat byte view of a C-contiguous buffer (of NumPy arrays of any dtype too)."""
    return (data.data if hasattr(data, "dtype") else memoryview(data)).cast("B")


def check_key(key: Any, what: str = "a key", within: str = "its checkpoint") -> str:
    """``key`` when it names an entry inside its store (``""``: the store itself): a
    relative, ``/``-separated string with no empty, ``.`` or ``..`` component and no NUL.
    Anything else, as read from an index, a manifest or a pointer, would lead out of the
    checkpoint: :class:`~distckpt.errors.UnsafePathError` naming ``what`` and the key."""
    if not isinstance(key, str):
        raise UnsafePathError(f"{what} is not a path: {key!r}")
    inside = key[:-1] if key.endswith("/") else key  # "dir/": the directory itself
    if key and ("\0" in key or any(part in ("", ".", "..") for part in inside.split("/"))):
        raise UnsafePathError(f"{what} {key!r} leads outside {within}")
    return key


def check_name(name: Any, what: str = "a name") -> str:
    """``name`` when it is one entry of a directory (:func:`check_key` without ``/``)."""
    if not isinstance(name, str) or not name or "/" in name:
        raise UnsafePathError(f"{what} {name!r} is not an entry of its directory")
    return check_key(name, what, "its directory")


@runtime_checkable
class ReadHandle(Protocol):
    """One object or file open for ranged reads; used by one thread at a time."""

    @property
    def size(self) -> int: ...

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        """Fill ``buffers`` in turn from ``offset``; return the bytes read (fewer at the end)."""

    def read(self, offset: int, length: int) -> bytes: ...

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        """The (offset, length) runs the next reads fall in: start fetching them."""

    def close(self) -> None: ...

    def __enter__(self) -> ReadHandle: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class WriteHandle(Protocol):
    """One object or file being written, each byte once, from several threads at once."""

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        """Write ``buffers`` back to back at ``offset``; return the bytes written."""

    def finish(self, durable: bool = True) -> None:
        """Make the object whole and visible (and, with ``durable``, on stable storage)."""

    def abort(self) -> None:
        """Give up: nothing of it needs to remain (idempotent, never raises)."""


@runtime_checkable
class Store(Protocol):
    """A directory or object prefix; keys are relative, ``/``-separated."""

    #: What users see: an absolute path or ``s3://bucket/prefix``. Never a credential.
    url: str
    #: Whether a directory can be renamed atomically (the commit strategy depends on it).
    renames: bool

    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> Store: ...

    def child(self, key: str) -> Store: ...

    def where(self, key: str) -> str:
        """The display form of ``key`` (for messages)."""

    def read(self, key: str) -> bytes: ...

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The object and a version tag for :meth:`put_if`."""

    def open(self, key: str, size: int | None = None) -> ReadHandle:
        """Open for ranged reads; ``size``, when known (from the index), saves a request."""

    def write(self, key: str, data: Buffer) -> None:
        """Create or replace a small object, durably."""

    def create(self, key: str, size_hint: int | None = None) -> WriteHandle: ...

    def put_new(self, key: str, data: Buffer) -> str:
        """Create ``key`` only if absent (else :class:`ConditionFailed`); return its version."""

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        """Replace ``key`` only if still at ``version`` (else :class:`ConditionFailed`)."""

    def exists(self, key: str) -> bool: ...

    def is_dir(self, key: str) -> bool:
        """Whether ``key`` is a directory (a prefix with objects under it)."""

    def age(self, key: str) -> float:
        """Seconds since ``key`` was last written (:class:`FileNotFoundError` if absent)."""

    def list(self, key: str = "") -> list[str]:
        """Names of the entries directly under ``key`` (objects and prefixes), sorted."""

    def walk(self, key: str = "") -> builtins.list[tuple[str, int, float]]:
        """Every object or file under ``key``: (key relative to ``key``, size, mtime)."""

    def delete(self, key: str) -> None:
        """Remove one object (absent: nothing happens)."""

    def delete_tree(self, key: str = "") -> None:
        """Remove everything under ``key`` (absent: nothing happens)."""

    def prepare(self, keys: Iterable[str]) -> None:
        """Make it possible to create ``keys`` (directories on a file system)."""

    def persist(self, keys: Iterable[str]) -> None:
        """Make the entries of the finished ``keys`` durable (directory fsyncs)."""


#: The entry-point group through which installed packages add stores: an entry named
#: after the URL scheme whose object is the store's opener (``opener(url) -> Store``, e.g.
#: a store class's ``from_url``).
ENTRY_POINTS = "distckpt.stores"

_openers: dict[str, Callable[[str], Store]] = {}


def _open_s3(url: str) -> Store:
    from distckpt.storage.s3 import S3Store

    return S3Store.from_url(url)


_BUILT_IN: dict[str, Callable[[str], Store]] = {"s3": _open_s3}


def register_store(scheme: str, opener: Callable[[str], Store]) -> None:
    """Open ``scheme://...`` locations with ``opener(url)`` (which returns a :class:`Store`)
    in this process; an installed package does the same through the ``distckpt.stores``
    entry-point group (:data:`ENTRY_POINTS`), without code at start-up."""
    if not scheme.isidentifier() or scheme == "file":
        raise ValueError(f"bad storage scheme {scheme!r}")
    _openers[scheme] = opener


def _opener(scheme: str, location: str) -> Callable[[str], Store]:
    found = _openers.get(scheme) or _BUILT_IN.get(scheme)
    if found is not None:
        return found
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINTS, name=scheme):
        opener = entry.load()
        _openers[scheme] = opener
        return opener  # type: ignore[no-any-return]
    known = sorted({*_BUILT_IN, *_openers, *entry_points(group=ENTRY_POINTS).names})
    raise ValueError(
        f"{location}: unsupported storage scheme {scheme!r} (known: "
        + ", ".join(f"{k}://" for k in known)
        + ", or a path)"
    )


def _scheme(location: object) -> str | None:
    """The URL scheme of ``location`` (None: a path; ``file://`` is a path)."""
    if not isinstance(location, str) or "://" not in location:
        return None
    scheme = location.split("://", 1)[0]
    return None if scheme == "file" else scheme


def is_remote(location: str | os.PathLike[str] | Store) -> bool:
    """Whether ``location`` names an object store: a store that cannot rename, or a URL
    (any scheme but ``file://``)."""
    if isinstance(location, Store):
        return not location.renames
    return _scheme(location) is not None


def resolve(location: str | os.PathLike[str] | Store) -> Store:
    """The store at ``location``: a store is returned as is, ``scheme://...`` is opened by
    the store registered for the scheme (``s3://bucket/prefix`` needs ``pip install
    'distckpt[s3]'``; others come from :func:`register_store` or an installed package's
    entry point), anything else is a local or shared directory (made absolute)."""
    if isinstance(location, Store):
        return location
    scheme = _scheme(location)
    if scheme is not None:
        assert isinstance(location, str)
        return _opener(scheme, location)(location)
    if isinstance(location, str) and location.startswith("file://"):
        location = location[len("file://") :]
    from distckpt.storage.posix import PosixStore

    return PosixStore(Path(location).absolute())


def location(store: Store) -> Path | str:
    """What results report as the place: the path of a directory, else the URL."""
    path = getattr(store, "path", None)
    return path if isinstance(path, Path) else store.url


def child_location(directory: str | os.PathLike[str] | Store, name: str) -> str:
    """``name`` in ``directory`` as users write it: a URL under an object store prefix, else
    the path ``os.path.join`` makes (relative stays relative)."""
    if isinstance(directory, Store) or is_remote(directory):
        return resolve(directory).where(name)
    return os.path.join(os.fspath(directory), name)


def join(*parts: str) -> str:
    """Keys joined with ``/`` (empty parts dropped)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))

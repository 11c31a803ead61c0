"""The storage seam: one small protocol for every place a checkpoint can live.

A :class:`Store` is a directory of a file system (:mod:`distckpt.storage.posix`) or a
prefix of an object store (:mod:`distckpt.storage.s3`, :mod:`distckpt.storage.cloud`: both
made by :class:`~distckpt.storage.object_store.ObjectStore` of a few primitives). Keys
are relative to it and use ``/``; its docstring states the rules every store keeps. The
engine, the manager and the CLI reach storage only through it; the training-state layer
never does.

What every backend provides, and who calls it during a save (``rank 0`` is the
coordinator):

1. rank 0: :meth:`Store.read` / :meth:`Store.list` / :meth:`Store.exists` to check the
   name is free, then begins the save's transaction (:mod:`distckpt.commit.transaction`);
2. every rank: :meth:`Store.prepare` for the keys it will write, :meth:`Store.create` for
   each piece (written at offsets, from several threads, then :meth:`WriteHandle.finish`),
   :meth:`Store.write` for small objects, :meth:`Store.persist` once all are finished;
3. rank 0: the commit primitives, :meth:`Store.put_new` (create only if absent) and
   :meth:`Store.put_if` (replace only the version read, from
   :meth:`Store.read_versioned`), and :meth:`Store.delete` / :meth:`Store.delete_tree`.

A load uses :meth:`Store.open` (ranged reads; :meth:`ReadHandle.will_need` says which
ranges come next, so an object store fetches each run once).

What a store can do it says in :attr:`Store.capabilities` (:class:`Capabilities`), and how
a save becomes a checkpoint on it in :attr:`Store.commit_strategy`, by name: ``"rename"``
a staging directory (for a store that also has the three methods of
:class:`RenamingStore`) or ``"claim"`` the name, then create the index last
(:mod:`distckpt.commit` implements both). distckpt asks the store, never its type.

Errors: a missing key is :class:`FileNotFoundError`; a failed condition is
:class:`ConditionFailed` (a :class:`FileExistsError`); a permanent service failure (no
such bucket, access denied, retries exhausted) is :class:`~distckpt.errors.StorageError`,
naming the location and the operation, never a credential.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, cast, runtime_checkable

from distckpt.errors import ConditionFailed as ConditionFailed  # the seam's own error
from distckpt.errors import StorageError, UnsafePathError

#: Anything with the buffer protocol: bytes, bytearray, memoryview, a NumPy array.
Buffer = Any


def byte_view(data: Buffer) -> memoryview:
    """A flat byte view of a C-contiguous buffer (of NumPy arrays of any dtype too)."""
    return (data.data if hasattr(data, "dtype") else memoryview(data)).cast("B")


def check_key(key: Any, what: str = "a key", within: str = "its checkpoint") -> str:
    """``key`` when it names an entry inside its store (``""``: the store itself): a
    relative, ``/``-separated string with no empty, ``.`` or ``..`` component, no NUL and
    no lone surrogate (which no file name encodes).
    Anything else, as read from an index, a manifest or a pointer, would lead out of the
    checkpoint: :class:`~distckpt.errors.UnsafePathError` naming ``what`` and the key."""
    if not isinstance(key, str):
        raise UnsafePathError(f"{what} is not a path: {key!r}")
    inside = key[:-1] if key.endswith("/") else key  # "dir/": the directory itself
    if key and ("\0" in key or any(part in ("", ".", "..") for part in inside.split("/"))):
        raise UnsafePathError(f"{what} {key!r} leads outside {within}")
    if not _is_text(key):
        raise UnsafePathError(f"{what} {key!r} is not text (a lone surrogate), so names no file")
    return key


def _is_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (as every path distckpt opens must)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_name(name: Any, what: str = "a name") -> str:
    """``name`` when it is one entry of a directory (:func:`check_key` without ``/``)."""
    if not isinstance(name, str) or not name or "/" in name:
        raise UnsafePathError(f"{what} {name!r} is not an entry of its directory")
    return check_key(name, what, "its directory")


def is_name(name: Any) -> bool:
    """Whether ``name`` is one entry of a directory (:func:`check_name` passes)."""
    try:
        check_name(name)
    except UnsafePathError:
        return False
    return True


@dataclass(frozen=True)
class Capabilities:
    """What a store can do, declared by its class (``capabilities = Capabilities(...)``).
    distckpt asks these flags, never the store's type; the conformance suite
    (:class:`distckpt.testing.StoreTests`) runs the cases the flags select."""

    #: A directory renames atomically, and :class:`RenamingStore`'s methods exist: what
    #: the :data:`~distckpt.commit.staging.RENAME` commit needs.
    renames: bool = False
    #: :meth:`Store.put_new` is atomic: of writers racing to create a key, from threads,
    #: processes or hosts, exactly one wins. The claim commit, the manager's lock and
    #: the ``latest`` pointer need it.
    conditional_create: bool = False
    #: :meth:`Store.put_if` is an atomic compare-and-swap on the version read. Needed
    #: by the same.
    conditional_update: bool = False
    #: A read at an offset fetches only the bytes asked. Every store answers ranged
    #: reads; one without them fetches the object to do so, and distckpt then reads
    #: each sharded piece whole, once.
    ranged_reads: bool = False
    #: A :class:`WriteHandle` takes writes at any offset, in any order, from several
    #: threads at once. A save needs it.
    parallel_writes: bool = False
    #: Keys are regular files of this machine, at the paths :meth:`Store.where` names
    #: (``url`` is a path too), and the store never follows a link inside it. A store
    #: without it is reached over a network (distckpt gives its transfers more workers).
    local_files: bool = False
    #: :class:`CopyingStore`'s ``copy`` takes an object of another store of the same kind
    #: without moving its bytes through this process (a hard link or reflink on a file
    #: system, a server-side copy on an object store): what an incremental save needs to
    #: reuse a piece of the checkpoint it builds on.
    copies: bool = False
    #: :class:`SyncingStore`'s ``sync`` makes many files finished with ``durable=False``
    #: durable in one write-back (on a file system, one ``syncfs``), where it can.
    syncs: bool = False

    def names(self) -> list[str]:
        """The flags that are set."""
        return [f.name for f in fields(self) if getattr(self, f.name)]


def require(store: Store, *flags: str, doing: str) -> None:
    """Raise :class:`~distckpt.errors.StorageError` naming ``store``, ``doing`` and each of
    ``flags`` (names of :class:`Capabilities`) that the store does not declare."""
    missing = [flag for flag in flags if not getattr(store.capabilities, flag)]
    if missing:
        raise StorageError(
            f"{store.url}: cannot {doing}: the store does not declare "
            + ", ".join(missing)
            + f" (its capabilities: {', '.join(store.capabilities.names()) or 'none'})"
        )


@runtime_checkable
class ReadHandle(Protocol):
    """One object or file open for ranged reads; used by one thread at a time."""

    @property
    def size(self) -> int:
        """The object's size in bytes."""

    def readinto(self, buffers: Sequence[Buffer], offset: int) -> int:
        """Fill ``buffers`` in turn from ``offset``; return the bytes read (fewer at the end)."""

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end, none past it)."""

    def will_need(self, runs: Sequence[tuple[int, int]]) -> None:
        """The (offset, length) runs the next reads fall in: start fetching them."""

    def close(self) -> None:
        """Release what the handle holds."""

    def __enter__(self) -> ReadHandle: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class WriteHandle(Protocol):
    """One object or file being written, each byte once, from several threads at once."""

    def write(self, buffers: Sequence[Buffer], offset: int) -> int:
        """Write ``buffers`` back to back at ``offset``; return the bytes written (after
        :meth:`finish` or :meth:`abort`: :class:`ValueError`)."""

    def finish(self, durable: bool = True) -> None:
        """Make the object whole and visible (and, with ``durable``, on stable storage)."""

    def abort(self) -> None:
        """Give up: nothing of it needs to remain (idempotent, never raises)."""


@runtime_checkable
class Store(Protocol):
    """A directory or object prefix; keys are relative, ``/``-separated.

    The rules every store keeps, as the conformance suite
    (:class:`distckpt.testing.StoreTests`) checks them. A subclass of
    :class:`~distckpt.storage.object_store.ObjectStore` (a store over a flat key space)
    keeps them by construction, but for what its primitives owe: atomic conditional
    puts, and clients made per process.

    * **Naming.** ``child(key).url == url + "/" + key`` and ``where(key)`` is the same
      string; ``child("")`` is the store itself; ``child("a").child("b") ==
      child("a/b")``; ``child("a/b").name == "b"`` and its ``parent == child("a")``
      (the parent of a store is the store one component up). A child reads what its
      parent wrote under its key.
    * **Identity.** Stores compare equal, and hash alike, when they are of one class at
      one location; ``__repr__`` names the class and the URL.
    * **Reopening and configuration.** ``open_store(store.url) == store``, in this
      process and in any other: every rank, and the processes the suite forks for its
      races, open a store from its URL alone. So what a store needs comes from the URL
      and the environment (credentials from the environment only, never in the URL),
      and a client made in one process is never used in another after a fork.
    * **Keys.** Every method refuses a key that leads outside the store (``..``, an
      absolute key, an empty or ``.`` component, a NUL; see :func:`check_key`) with
      :class:`~distckpt.errors.UnsafePathError`, before it reads or writes anything.
    * **Objects.** :meth:`write` takes any buffer (bytes, bytearray, memoryview, a
      NumPy array; empty too) and replaces what was there. A missing key is a
      :class:`FileNotFoundError` from :meth:`read`, :meth:`read_versioned`, :meth:`age`
      and :meth:`open` (when opened or at the first read); :meth:`delete` and
      :meth:`delete_tree` of what is absent do nothing.
    * **Prefixes.** A directory (on an object store: a prefix with objects under it)
      exists (:meth:`exists`) as an object does, and :meth:`is_dir` says which it is;
      its :meth:`age` is since something in it was last written. :meth:`list` names the
      entries directly under a key, sorted, without repeats (``[]`` for an object or
      nothing; ``"b/"`` is ``"b"``); :meth:`walk` gives every object below, in any
      order; :meth:`delete_tree` leaves no entry below, and ``delete_tree()`` empties
      the store.
    * **Ranged reads.** A :class:`ReadHandle` knows its size; a read at the end is short
      and past it empty, as from a file; reads inside and outside the runs
      :meth:`ReadHandle.will_need` announced (past the end too) give the same bytes.
    * **Writes at offsets.** A :class:`WriteHandle` takes pieces in any order, from
      several threads, with or without a size hint; the object appears whole at
      :meth:`WriteHandle.finish` (``durable=False`` too). :meth:`WriteHandle.abort` is
      idempotent, leaves nothing of an unfinished object, and after a finish leaves the
      object alone; a write after either is a :class:`ValueError`.
    * **Conditional writes.** :meth:`put_new` and :meth:`put_if` return the new version,
      a non-empty string equal to what :meth:`read_versioned` then gives. ``put_new``
      fails (:class:`ConditionFailed`, a :class:`FileExistsError`) on any object there,
      one written plainly too; ``put_if`` fails on a version that is no longer current
      or an object that is gone, and then creates nothing. Every write gives a new
      version. Of writers racing for one condition, threads through two clients or
      processes each opening the URL, exactly one wins and the object holds its bytes.
    * **Declarations.** :attr:`capabilities` equals the class's declaration; the
      :attr:`commit_strategy` names a strategy whose needs the capabilities meet; a
      store that declares ``renames`` is a :class:`RenamingStore`; it is remote
      (:func:`~distckpt.storage.registry.is_remote`) exactly when it does not declare
      ``local_files``.
    * **Flags' own rules** (each case runs only for a store that declares the flag):
      see :class:`RenamingStore`, :class:`CopyingStore`, :class:`SyncingStore` and
      :attr:`Capabilities.local_files`.
    """

    #: What users see: an absolute path or ``s3://bucket/prefix``. Never a credential.
    url: str

    @property
    def capabilities(self) -> Capabilities:
        """What the store can do (a class attribute)."""

    @property
    def commit_strategy(self) -> str:
        """How a save becomes a checkpoint on it (a class attribute), by name:
        ``"rename"`` (:data:`~distckpt.commit.staging.RENAME`) or ``"claim"``
        (:data:`~distckpt.commit.claim.CLAIM`)."""

    @property
    def name(self) -> str:
        """The last component of the store's location."""

    @property
    def parent(self) -> Store:
        """The store one component up."""

    def child(self, key: str) -> Store:
        """The store at ``key`` below this one (``child("")`` is this store)."""

    def where(self, key: str) -> str:
        """The display form of ``key`` (for messages)."""

    def read(self, key: str) -> bytes:
        """The whole object at ``key`` (:class:`FileNotFoundError` if absent)."""

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The object and a version tag for :meth:`put_if` (a tag may name the bytes:
        writing the same bytes again may give the same tag)."""

    def open(self, key: str, size: int | None = None) -> ReadHandle:
        """Open for ranged reads; ``size``, when known (from the index), saves a request."""

    def write(self, key: str, data: Buffer) -> None:
        """Create or replace a small object, durably."""

    def create(self, key: str, size_hint: int | None = None) -> WriteHandle:
        """A :class:`WriteHandle` for a new object at ``key``, which appears whole at its
        :meth:`~WriteHandle.finish`; ``size_hint`` is its size, when known."""

    def put_new(self, key: str, data: Buffer) -> str:
        """Create ``key`` only if absent (else :class:`ConditionFailed`); return its version."""

    def put_if(self, key: str, data: Buffer, version: str) -> str:
        """Replace ``key`` only if still at ``version`` (else :class:`ConditionFailed`)."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` is an object or a directory."""

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
        """Make the entries of ``keys`` durable, as they now are: created, renamed or
        removed (directory fsyncs on a file system; nothing to do on an object store)."""


@runtime_checkable
class RenamingStore(Store, Protocol):
    """A store whose directories rename atomically (``capabilities.renames``): what the
    :data:`~distckpt.commit.staging.RENAME` commit calls beyond :class:`Store`."""

    def rename(self, key: str, new_key: str) -> None:
        """Give the directory ``key`` the name ``new_key``, atomically: readers see one or
        the other, never a part. A ``new_key`` that holds entries is never replaced (an
        :class:`OSError`); one that does not exist is created."""

    def exchange(self, key: str, other: str) -> bool:
        """Swap the directories ``key`` and ``other`` atomically; False (nothing done)
        where the store cannot, and the commit then makes do with two renames."""

    def touch(self, key: str) -> None:
        """Make ``key`` look just written to :meth:`Store.age` (a heartbeat)."""


@runtime_checkable
class CopyingStore(Store, Protocol):
    """A store that copies objects without moving their bytes (``capabilities.copies``)."""

    def copy(self, source: Store, source_key: str, key: str, *, expect: str | None = None) -> None:
        """Make ``key`` (new) hold what ``source_key`` of ``source`` (a store of the same
        kind, e.g. a sibling checkpoint) holds, durably once :meth:`Store.persist` made
        ``key`` so, and independent of it from then on: deleting either leaves the other
        whole. :class:`FileNotFoundError` when the source is gone; :class:`TypeError`
        when ``source`` is not a store this one can copy from; with ``expect`` (a
        :meth:`stamp` of the source taken earlier), :class:`ConditionFailed` when the
        source is no longer what it was then, and nothing is left at ``key``."""

    def stamp(self, key: str) -> str | None:
        """A token that changes whenever ``key`` is written again (on a file system its
        inode, size and modification time; an object's version), or None where the store
        has none."""


@runtime_checkable
class SyncingStore(Store, Protocol):
    """A store that makes many new files durable at once (``capabilities.syncs``)."""

    def can_sync(self) -> bool:
        """Whether :meth:`sync` works here (on a file system: one whose ``syncfs`` writes
        back everything and reports failures); else files are made durable one by one."""

    def sync(self, keys: Iterable[str]) -> None:
        """Make the files ``keys`` (finished with ``durable=False``) durable at once, and
        with them every file and directory entry made in the store so far (what
        :meth:`Store.persist` does for names); an :class:`OSError` if any write-back
        failed."""


def syncing(store: Store) -> SyncingStore | None:
    """``store`` as a :class:`SyncingStore` when it declares ``syncs`` and can sync where
    it is, else None."""
    if not store.capabilities.syncs:
        return None
    found = cast(SyncingStore, store)
    return found if found.can_sync() else None


def write_whole(store: Store, key: str, buffers: Sequence[Buffer], *, durable: bool = True) -> int:
    """Write a new file ``key`` of ``buffers`` back to back through :meth:`Store.create`
    and finish it (durably, or for a later :meth:`SyncingStore.sync`); a failure gives
    the file up. Returns the bytes written."""
    handle = store.create(key, sum(byte_view(b).nbytes for b in buffers))
    try:
        size = handle.write(buffers, 0)
        handle.finish(durable)
    except BaseException:
        handle.abort()
        raise
    return size


def own_write(store: Store, key: str, body: bytes, error: ConditionFailed) -> str:
    """After a conditional write of ``body`` to ``key`` failed its condition on a retry:
    the version of ``key`` if it holds exactly ``body`` (the first try landed and its
    answer was lost), else ``error`` is raised."""
    try:
        current, version = store.read_versioned(key)
    except FileNotFoundError:
        raise error from None
    if current == body:
        return version
    raise error


def copying(store: Store) -> CopyingStore | None:
    """``store`` as a :class:`CopyingStore` when it declares ``copies``, else None (asked
    of the flag: an ``isinstance`` of a protocol costs tens of microseconds a call)."""
    return cast(CopyingStore, store) if store.capabilities.copies else None


def join(*parts: str) -> str:
    """Keys joined with ``/`` (empty parts dropped)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))

"""Where a location's store comes from: a path is a :class:`~distckpt.storage.posix.PosixStore`,
``s3://``, ``az://`` and ``gs://`` are the built-in object stores, and any other scheme is a
plug-in registered with :func:`register_store` or through the ``distckpt.stores`` entry-point
group (:data:`ENTRY_POINTS`). distckpt asks :func:`open_store` for every location a user
gives; nothing else in it names a store class."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from distckpt.errors import CheckpointError, LocationError
from distckpt.storage.backend import Store
from distckpt.storage.posix import PosixStore

if TYPE_CHECKING:
    from typing_extensions import TypeIs

#: The entry-point group through which installed packages add stores: an entry named
#: after the URL scheme whose object is the store's opener (``opener(url) -> Store``, e.g.
#: a store class's ``from_url``).
ENTRY_POINTS = "distckpt.stores"

_openers: dict[str, Callable[[str], Store]] = {}


def _open_s3(url: str) -> Store:
    from distckpt.storage.s3 import S3Store

    return S3Store.from_url(url)


def _open_cloud(url: str) -> Store:
    from distckpt.storage.cloud import CloudStore

    return CloudStore.from_url(url)


_BUILT_IN: dict[str, Callable[[str], Store]] = {
    "s3": _open_s3,
    "az": _open_cloud,
    "gs": _open_cloud,
}


def register_store(scheme: str, opener: Callable[[str], Store]) -> None:
    """Open ``scheme://...`` locations with ``opener(url)`` (which returns a :class:`Store`)
    in this process; an installed package does the same through the ``distckpt.stores``
    entry-point group (:data:`ENTRY_POINTS`), without code at start-up. ``opener`` raises
    :class:`ValueError` for a URL it cannot parse; callers of :func:`open_store` see it as a
    :class:`~distckpt.errors.LocationError`."""
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
    raise LocationError(
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


def _is_store(location: object) -> TypeIs[Store]:
    """Whether ``location`` is a :class:`Store`. A path or a string never is, and is told
    apart first: ``isinstance`` against the protocol checks each of its methods, which
    every open of a location paid (a fifth of a load's time in a small checkpoint)."""
    return not isinstance(location, str | PurePath) and isinstance(location, Store)


def is_remote(location: str | os.PathLike[str] | Store) -> bool:
    """Whether ``location`` is reached over a network: its store does not declare
    ``local_files`` (a path never is; a URL is asked of the store its scheme opens)."""
    if not _is_store(location) and _scheme(location) is None:
        return False
    return not open_store(location).capabilities.local_files


def open_store(location: str | os.PathLike[str] | Store) -> Store:
    """The store at ``location``: a store is returned as is, ``scheme://...`` is opened by
    the store registered for the scheme (``s3://bucket/prefix`` needs ``pip install
    'distckpt[s3]'``; others come from :func:`register_store` or an installed package's
    entry point), anything else is a local or shared directory (made absolute).

    An unknown scheme, or a URL its store cannot parse (the store's opener raised a
    :class:`ValueError`), is a :class:`~distckpt.errors.LocationError` (a
    :class:`~distckpt.errors.CheckpointError` and a :class:`ValueError`)."""
    if _is_store(location):
        return location
    scheme = _scheme(location)
    if scheme is not None:
        assert isinstance(location, str)
        opener = _opener(scheme, location)
        try:
            return opener(location)
        except CheckpointError:
            raise
        except ValueError as exc:  # the URL does not parse (a plug-in's own message)
            text = str(exc) or type(exc).__name__
            raise LocationError(text if location in text else f"{location}: {text}") from exc
    if isinstance(location, str) and location.startswith("file://"):
        location = location[len("file://") :]
    return PosixStore(Path(location).absolute())


def location(store: Store) -> Path | str:
    """What results report as the place: the path of a store of local files, else the URL."""
    return Path(store.url) if store.capabilities.local_files else store.url


def child_location(directory: str | os.PathLike[str] | Store, name: str) -> str:
    """``name`` in ``directory`` as users write it: under a store or a URL as the store
    writes it, else the path ``os.path.join`` makes (relative stays relative)."""
    if _is_store(directory) or _scheme(directory) is not None:
        return open_store(directory).where(name)
    return os.path.join(os.fspath(directory), name)

"""Deleting one committed checkpoint: :func:`remove`."""

from __future__ import annotations

import os

from distckpt.commit.transaction import retire
from distckpt.errors import CheckpointNotFoundError
from distckpt.format.index import is_committed
from distckpt.storage.backend import Store
from distckpt.storage.registry import location, open_store


def remove(path: str | os.PathLike[str] | Store, *, missing_ok: bool = False) -> None:
    """Delete the committed checkpoint at ``path`` so that no reader ever sees half of it
    (on a file system: marked, renamed out of sight, then removed; on an object store: its
    index first, then its data). One process calls it, not every rank.

    Only a distckpt checkpoint is deleted: anything else at ``path`` (a file, another
    format, a link) raises :class:`~distckpt.CheckpointNotFoundError` and is left alone,
    as is a missing ``path`` with ``missing_ok=True``::

        distckpt.remove("run/ckpt-10")
    """
    store = open_store(path)
    if is_committed(store):
        retire(store)
        return
    where = location(store)
    if missing_ok and not store.parent.exists(store.name):
        return
    raise CheckpointNotFoundError(f"{where} is not a committed distckpt checkpoint; left alone")

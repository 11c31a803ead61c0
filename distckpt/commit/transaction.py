"""How a save becomes a checkpoint: the store's commit strategy, asked, never guessed.

Every store names its strategy (``commit_strategy``, see :mod:`distckpt.commit.strategy`):
the rename of a staging directory (:data:`~distckpt.commit.staging.RENAME`, file
systems) or a claim, then the index last (:data:`~distckpt.commit.claim.CLAIM`, object
stores). The functions here ask the store for it, check that the store declares the
capabilities it needs, and call it.

Call order (the coordinator makes every call but :func:`save_root`)::

    txn = begin(final, token, world_size, overwrite=...)   # name checked, claimed
    # every rank writes its pieces under save_root(final, token)
    txn.commit(files, index)     # or txn.abort() after any failure
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import cast

from distckpt.commit.claim import CLAIM
from distckpt.commit.staging import RENAME
from distckpt.commit.strategy import CommitStrategy, Pending, Transaction
from distckpt.errors import StorageError
from distckpt.storage.backend import Store, require
from distckpt.storage.registry import open_store

__all__ = [
    "Pending",
    "Transaction",
    "begin",
    "collect_garbage",
    "leftovers",
    "pending",
    "retire",
    "retiring",
    "save_root",
    "skipped",
    "strategy",
    "withdraw",
]


#: The commit strategies by the name a store declares in ``commit_strategy``.
STRATEGIES: dict[str, CommitStrategy] = {RENAME.name: RENAME, CLAIM.name: CLAIM}


def declared(store: Store) -> CommitStrategy:
    """The commit strategy ``store`` names (or, from a plug-in, hands over as an object of
    its own); :class:`~distckpt.errors.StorageError` for a name that is none."""
    named: object = store.commit_strategy
    found = STRATEGIES.get(named) if isinstance(named, str) else cast(CommitStrategy, named)
    if found is None:
        raise StorageError(
            f"{store.url}: unknown commit strategy {named!r} "
            f"(a store declares one of {', '.join(map(repr, STRATEGIES))})"
        )
    return found


def strategy(store: Store) -> CommitStrategy:
    """The commit strategy ``store`` declares, once it is seen to have what it needs
    (else :class:`~distckpt.errors.StorageError` naming the missing capabilities)."""
    found = declared(store)
    require(store, *found.requires, doing=f"commit by {found.name}")
    return found


def save_root(final: Store, token: str) -> Store:
    """Where the ranks of save ``token`` write its pieces."""
    return strategy(final).save_root(final, token)


def begin(final: Store, token: str, world_size: int, *, overwrite: bool) -> Transaction:
    """Check that ``final`` may be written (it holds no committed checkpoint, or
    ``overwrite``; nothing that is not a checkpoint), clean up abandoned saves beside it,
    and start the save. A store that cannot take a save's writes is refused here, before
    any rank writes."""
    require(final, "parallel_writes", doing="save a checkpoint")
    return strategy(final).begin(final, token, world_size, overwrite=overwrite)


def retire(checkpoint: Store) -> None:
    """Delete a committed checkpoint so that no reader ever sees half of it: on a file
    system mark it, rename it out of sight, then remove it; on an object store delete its
    index first, then its data."""
    strategy(checkpoint).retire(checkpoint)


def withdraw(checkpoint: Store) -> Callable[[], None]:
    """The first part of :func:`retire`: once it returns nobody opens or adopts
    ``checkpoint``; it returns the rest of the deletion (see
    :meth:`~distckpt.commit.strategy.CommitStrategy.retire`)."""
    found = strategy(checkpoint)
    first = getattr(found, "withdraw", None)
    if first is None:  # a plug-in's strategy without it: all of retire is the rest
        return lambda: found.retire(checkpoint)
    rest: Callable[[], None] = first(checkpoint)
    return rest


def retiring(checkpoint: Store) -> bool:
    """Whether ``checkpoint`` was being deleted by a retention that did not finish."""
    return strategy(checkpoint).retiring(checkpoint)


def collect_garbage(directory: str | os.PathLike[str] | Store) -> list[str]:
    """Remove abandoned saves in ``directory`` (never a live one); return what went."""
    store = open_store(directory)
    return strategy(store).collect_garbage(store)


def skipped(directory: str | os.PathLike[str] | Store) -> list[tuple[str, str]]:
    """Entries of ``directory`` named like leftovers of saves that are not (never
    removed, never fatal), with why."""
    store = open_store(directory)
    return strategy(store).skipped(store)


def pending(directory: Store) -> list[Pending]:
    """The uncommitted saves in ``directory``, sorted by name."""
    return strategy(directory).pending(directory)


def leftovers(directory: str | os.PathLike[str] | Store) -> list[str]:
    """Saves in ``directory`` that are running or were abandoned."""
    store = open_store(directory)
    return strategy(store).leftovers(store)

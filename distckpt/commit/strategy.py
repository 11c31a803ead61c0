"""Commit strategies: how a save becomes a checkpoint on a store, named and declared by it.

A store says how its saves commit with one class attribute, ``commit_strategy``, one of
two objects that implement :class:`CommitStrategy`:

* :data:`~distckpt.commit.staging.RENAME` (``"rename"``): the ranks write into a staging
  directory beside the checkpoint's name; the commit renames it into place. Needs
  ``capabilities.renames`` and the methods of
  :class:`~distckpt.storage.backend.RenamingStore` (``rename``, ``exchange``, ``touch``).
* :data:`~distckpt.commit.claim.CLAIM` (``"claim"``): the coordinator claims the name with
  a lease beside it, the ranks write under the name itself, and the index, created only
  if absent, is the commit. Needs ``conditional_create`` and ``conditional_update``.

:mod:`distckpt.commit.transaction` asks the store for its strategy and calls it; nothing
else in distckpt knows which one a store uses. Call order of one save::

    root = strategy.save_root(final, token)        # every rank: where it writes
    txn = strategy.begin(final, token, world_size, overwrite=...)   # coordinator
    # every rank writes its pieces under root
    txn.commit(files, index)                       # coordinator; or txn.abort()

Retention calls :meth:`CommitStrategy.retire` (coordinator), readers of a run directory
:meth:`~CommitStrategy.retiring`, every save and ``distckpt gc``
:meth:`~CommitStrategy.collect_garbage`, ``distckpt ls``
:meth:`~CommitStrategy.pending`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from distckpt.storage.backend import Store


class Transaction(Protocol):
    """One save's way to its commit (coordinator only)."""

    #: Where the ranks write (a staging directory, or the checkpoint's prefix itself).
    root: Store

    def commit(self, files: dict[str, bytes], index: bytes) -> None:
        """Write ``files`` (key: bytes, the groups' metadata), then the index; the
        checkpoint exists from then on."""

    def abort(self) -> None:
        """Remove what the save wrote; never raises."""


@dataclass
class Pending:
    """A save in a run directory that has not committed: running, or abandoned."""

    name: str  # the entry holding it: its staging directory, or the checkpoint prefix
    target: str  # the checkpoint name it saves
    live: bool  # its heartbeat is fresh
    started: float | None  # Unix time, when known
    bytes: int


class CommitStrategy(Protocol):
    """How saves become checkpoints, and checkpoints stop being, on one kind of store."""

    #: Its name, for messages.
    name: str
    #: The :class:`~distckpt.storage.backend.Capabilities` flags a store needs for it.
    requires: tuple[str, ...]

    def save_root(self, final: Store, token: str) -> Store:
        """Where the ranks of save ``token`` of checkpoint ``final`` write (every rank)."""

    def begin(self, final: Store, token: str, world_size: int, *, overwrite: bool) -> Transaction:
        """Check that ``final`` may be written (it holds no committed checkpoint, or
        ``overwrite``; nothing that is not a checkpoint), clean up abandoned saves beside
        it, and start the save (coordinator)."""

    def retire(self, checkpoint: Store) -> None:
        """Delete a committed checkpoint so that no reader ever sees half of it.

        A strategy may also have ``withdraw(checkpoint) -> Callable[[], None]``, the first
        part of it: from then on nobody opens or adopts ``checkpoint``; it returns the
        rest of the deletion (which a later :meth:`collect_garbage` finishes if it never
        runs). Background retention runs that rest off the save path; without
        ``withdraw``, all of :meth:`retire` is the rest."""

    def retiring(self, checkpoint: Store) -> bool:
        """Whether ``checkpoint`` was being deleted by a retention that did not finish."""

    def collect_garbage(self, directory: Store) -> list[str]:
        """Remove the abandoned saves and retirements in ``directory``, never a live one;
        return the locations removed."""

    def pending(self, directory: Store) -> list[Pending]:
        """The uncommitted saves in ``directory``, sorted by name."""

    def leftovers(self, directory: Store) -> list[str]:
        """The locations of the saves in ``directory`` that are running or were
        abandoned, and of unfinished retirements."""

    def skipped(self, directory: Store) -> list[tuple[str, str]]:
        """The entries of ``directory`` named like leftovers that are not (a name that
        does not parse, a link), with why: :meth:`collect_garbage` leaves them alone."""

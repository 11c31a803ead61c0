"""The commit by claim (:data:`CLAIM`), for stores without rename: "a claim, then the
index last".

A checkpoint on such a store (an object store) exists exactly when its index object (the
root ``zarr.json``) exists. A save of ``<prefix>``:

1. **claims the name** (coordinator): creates ``.<name>.distckpt-save`` beside the
   prefix only if absent (a conditional put, ``If-None-Match``), a lease
   (:mod:`distckpt.commit.lease`) holding the save's token, host and pid: the save's
   heartbeat object. Beside the prefix, not in it: one listing of a run directory finds
   every save in it, so the garbage collection that precedes every save costs one
   request while nothing is stale. A second save of
   the same name finds the claim and fails with :class:`~distckpt.errors.CheckpointExists`,
   unless the claim is stale: it then takes the claim over by a put conditional on the
   version it read (``If-Match``), so of two that find one stale claim only one wins.
   A save whose claim was taken over (after a long stall) learns it and fails instead of
   committing.
2. **writes the data** (every rank): the arrays' objects straight under ``<prefix>``.
3. **commits** (coordinator): writes the groups' metadata, then the index with
   ``If-None-Match``, so two saves can never both commit one name; then deletes the
   claim. Readers, ``ls`` and the manager never read a prefix that has no index.

``overwrite=True`` of a committed checkpoint withdraws the old one before writing: its
index first (from then on nobody opens it), then its data. A reader therefore sees the
old checkpoint, none, or the new one; one that opened the old index before reads every
chunk against that index's checksums and gets
:class:`~distckpt.errors.CorruptCheckpointError` for any replaced object, never a mix.
Unlike the rename on a file system, the old checkpoint is gone if the new save fails.

Retention (:func:`retire`) marks a checkpoint, deletes its index first, then its data.
Abandoned saves and retirements (a stale claim and no index) are removed by
:func:`collect_garbage`, incomplete multipart uploads with them
(:meth:`~distckpt.storage.s3.S3Store.delete_tree` aborts those).

It needs of a store only :class:`~distckpt.storage.backend.Store`'s methods, with
``conditional_create`` and ``conditional_update``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from distckpt.commit.lease import STALE_SECONDS, Lease, describe, pid_dead, read_lease
from distckpt.commit.strategy import Pending
from distckpt.errors import CheckpointExists
from distckpt.format import seal
from distckpt.format.zarr_meta import ZARR_JSON
from distckpt.storage.backend import ConditionFailed, Store, is_name

log = logging.getLogger(__name__)

SUFFIX = ".distckpt-save"
_CLAIM = re.compile(r"^\.(?P<name>.+)\.distckpt-save$")


def claim_key(name: str) -> str:
    """The key, in the directory holding checkpoint ``name``, of the claim on it."""
    return f".{name}{SUFFIX}"


def read_claim(checkpoint: Store) -> tuple[dict[str, Any], str, float] | None:
    """The claim on ``checkpoint`` (owner, version, age in seconds), or None."""
    return read_lease(checkpoint.parent, claim_key(checkpoint.name))


class ClaimCommit:
    """A save's claim on one checkpoint name (coordinator only)."""

    def __init__(self, final: Store, token: str, world_size: int, *, overwrite: bool) -> None:
        self.final = final
        self.root = final  # the ranks write in place: there is nothing to rename
        self.token = token
        names = final.list()
        if names and ZARR_JSON not in names and read_claim(final) is None:
            raise CheckpointExists(
                f"{final.url} holds objects but no distckpt checkpoint; not touching it"
            )
        self._lease = Lease(final.parent, claim_key(final.name), token, {"world_size": world_size})

        def busy(owner: dict[str, Any], age: float) -> Exception:
            return CheckpointExists(
                f"another save is writing {final.url} ({describe(owner)}, last heartbeat "
                f"{age:.0f}s ago)"
            )

        self._lease.acquire(busy)
        try:
            if final.exists(ZARR_JSON):
                if not overwrite:
                    raise CheckpointExists(
                        f"{final.url} already holds a committed checkpoint; pass "
                        "overwrite=True to replace it"
                    )
                # Withdraw the old checkpoint: its index first, so nobody opens it again.
                final.delete(ZARR_JSON)
            final.delete_tree()
        except BaseException:
            self._lease.release()
            raise

    def commit(self, files: dict[str, bytes], index: bytes) -> None:
        """Write ``files`` (the groups' metadata), then the index, conditionally; then
        release the claim."""
        self._lease.stop()
        if self._lease.lost or not self._lease.ours():
            raise CheckpointExists(
                f"{self.final.url}: this save lost its claim (it was taken over by another "
                "save after a long stall); not committing"
            )
        for key, data in files.items():
            self.final.write(key, data)
        try:
            self.final.put_new(ZARR_JSON, index)
        except ConditionFailed:
            raise CheckpointExists(
                f"{self.final.url} was committed by another save while this one ran"
            ) from None
        self._lease.release()

    def abort(self) -> None:
        """Remove what this save wrote (only while it holds the claim and nothing was
        committed under the name)."""
        self._lease.stop()
        try:
            if self._lease.ours() and not self.final.exists(ZARR_JSON):
                self.final.delete_tree()
            self._lease.release()
        except Exception as exc:
            log.warning("could not clean up the failed save of %s: %s", self.final.url, exc)


def retire(checkpoint: Store) -> None:
    """Delete a committed checkpoint: mark it (a claim that says so), delete its index, so
    nobody opens it again, then its data, then the mark. If this stops half way, the mark
    goes stale and :func:`collect_garbage` finishes the job."""
    withdraw(checkpoint)()


def withdraw(checkpoint: Store) -> Callable[[], None]:
    """Mark ``checkpoint`` for deletion and delete its index (nobody opens it again);
    return the deletion of its data, then of the mark."""
    doc = {"token": "retire", "deleting": True, "host": socket.gethostname(), "pid": os.getpid()}
    key = claim_key(checkpoint.name)
    checkpoint.parent.write(key, seal.encode({**doc, "beat": time.time()}))
    checkpoint.delete(ZARR_JSON)

    def remove() -> None:
        checkpoint.delete_tree()
        checkpoint.parent.delete(key)

    return remove


def retiring(checkpoint: Store) -> bool:
    """Whether ``checkpoint`` is marked for deletion by a retention that did not finish."""
    found = read_claim(checkpoint)
    return found is not None and bool(found[0].get("deleting"))


def collect_garbage(directory: Store, stale_seconds: float = STALE_SECONDS) -> list[str]:
    """Remove the abandoned saves in ``directory`` (a stale claim and no index) and stale
    claims left beside committed checkpoints; return the locations removed. One listing
    of ``directory``, then requests only for the claims it finds."""
    removed: list[str] = []
    for name in leftovers(directory):
        prefix = directory.child(name)
        found = read_claim(prefix)
        if found is None or live(found, stale_seconds):
            continue
        key = claim_key(name)
        if prefix.exists(ZARR_JSON) and not found[0].get("deleting"):
            directory.delete(key)  # a commit that died after its index: nothing to undo
            continue
        log.info("removing abandoned save %s (%s)", prefix.url, describe(found[0]))
        prefix.delete(ZARR_JSON)
        prefix.delete_tree()
        directory.delete(key)
        removed.append(prefix.url)
    return removed


def live(claim: tuple[dict[str, Any], str, float], stale_seconds: float = STALE_SECONDS) -> bool:
    """Whether the save holding ``claim`` (from :func:`read_claim`) may still run: its
    heartbeat is fresh and, on this host, its process exists."""
    owner, _, age = claim
    return age < stale_seconds and not pid_dead(owner)


def leftovers(directory: Store) -> list[str]:
    """The checkpoint names in ``directory`` that have a claim beside them (saves running
    or abandoned, retirements unfinished), from one listing."""
    return [m["name"] for m in map(_CLAIM.match, directory.list()) if m and is_name(m["name"])]


def skipped(directory: Store) -> list[tuple[str, str]]:
    """The claims in ``directory`` whose name does not name a checkpoint (``..distckpt-save``
    would be a claim on ``.``): what :func:`collect_garbage` leaves alone."""
    return [
        (directory.where(n), "its name does not parse as .NAME.distckpt-save")
        for n in directory.list()
        if n.endswith(SUFFIX) and ((m := _CLAIM.match(n)) is None or not is_name(m["name"]))
    ]


def pending(directory: Store) -> list[Pending]:
    """The uncommitted saves in ``directory`` (a claim and no index), sorted by name."""
    found = []
    for name in leftovers(directory):
        prefix = directory.child(name)
        claim = read_claim(prefix)
        if claim is None or prefix.exists(ZARR_JSON):
            continue  # committed meanwhile, or a commit's claim not yet released
        started = claim[0].get("time")
        found.append(
            Pending(
                name,
                name,
                live(claim),
                float(started) if isinstance(started, (int, float)) else None,
                sum(size for _, size, _ in prefix.walk()),
            )
        )
    return found


class ClaimStrategy:
    """The commit strategy of stores without rename (see the module)."""

    name = "claim"
    requires: tuple[str, ...] = ("conditional_create", "conditional_update")

    def __repr__(self) -> str:
        return "CLAIM"

    def save_root(self, final: Store, token: str) -> Store:
        return final  # the ranks write in place: there is nothing to rename

    def begin(self, final: Store, token: str, world_size: int, *, overwrite: bool) -> ClaimCommit:
        collect_garbage(final.parent)
        return ClaimCommit(final, token, world_size, overwrite=overwrite)

    def retire(self, checkpoint: Store) -> None:
        retire(checkpoint)

    def withdraw(self, checkpoint: Store) -> Callable[[], None]:
        return withdraw(checkpoint)

    def retiring(self, checkpoint: Store) -> bool:
        return retiring(checkpoint)

    def collect_garbage(self, directory: Store) -> list[str]:
        return collect_garbage(directory)

    def pending(self, directory: Store) -> list[Pending]:
        return pending(directory)

    def leftovers(self, directory: Store) -> list[str]:
        return [directory.where(name) for name in leftovers(directory)]

    def skipped(self, directory: Store) -> list[tuple[str, str]]:
        return skipped(directory)


#: The commit by claim (see the module): ``commit_strategy = CLAIM``.
CLAIM = ClaimStrategy()

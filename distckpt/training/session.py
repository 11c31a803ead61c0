"""One restore in progress: the checkpoint's names, what matched, and the reads.

A :class:`RestoreSession` is created by :meth:`Checkpoint.restore
<distckpt.training.Checkpoint.restore>` and lives as long as values may still arrive:
nodes of the graph keep it (see :class:`~distckpt.training.tracking.Position`) and
restore children assigned to them later; lazy modules keep it until their first
forward. A later ``restore`` of the same root deactivates it.

Reads go through the session's :class:`Source`: a persistent checkpoint
(:class:`StoredCheckpoint`, read as :func:`distckpt.load` does) or a step of the
node-local tier (:class:`distckpt.local.restore.LocalStep`). They are collective:
every rank must reach each restore, delayed ones included, at the same point, as SPMD
training code does. Python values are read from the index directly.

Ranks may hold different objects (pipeline stages): a checkpoint value counts as
consumed once any rank has read it. Each restore step ends with one collective that
agrees on the values no rank has read yet (:meth:`RestoreSession.unused`), so a status
asserts over the job without communicating.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from distckpt import dtypes
from distckpt.comm import Communicator, raise_if_any_failed
from distckpt.comm.outcome import Failure, first_failure
from distckpt.engine import reuse
from distckpt.engine.load import load_indexed, read_shared_index
from distckpt.errors import CorruptCheckpointError, ShapeMismatchError
from distckpt.format.backed import check_stored
from distckpt.format.stored import Pieces
from distckpt.items import PerRank, Shard, is_dtensor
from distckpt.pipeline.matching import gather_left
from distckpt.pipeline.options import CheckpointOptions, resolve_run
from distckpt.signing.keys import TrustSource, trusted_keys
from distckpt.storage.backend import Store
from distckpt.storage.registry import location, open_store
from distckpt.training.handlers import TensorNames, plan_restore
from distckpt.training.names import MISSING, ancestors, descend, expand, nest, parts
from distckpt.training.plan import Plan, Slot
from distckpt.values import decode

log = logging.getLogger("distckpt")

#: Reserved top-level names a Checkpoint writes next to the graph's variables.
SAVE_COUNTER = "save_counter"
ALIASES = "_aliases"


class Source(Protocol):
    """Where a restore reads from: a checkpoint's ``index`` (read once) and a ``load`` of
    a nested state from it, collective, as :func:`distckpt.load`; ``store`` holds it."""

    path: Any
    store: Store

    @property
    def index(self) -> Mapping[str, Any]: ...

    def load(self, state: dict[str, Any], comm: Communicator, options: CheckpointOptions) -> Any:
        """Collective: fill ``state`` as :func:`distckpt.load` with ``options`` does."""


class StoredCheckpoint:
    """A checkpoint in a directory or object store: its index is read once, by rank 0,
    for every round of loads of a restore. Collective to construct. ``trusted``: the
    keys it must be signed by (see :mod:`distckpt.signing`; also, when None, those
    ``$DISTCKPT_TRUSTED_KEYS`` names)."""

    def __init__(
        self, path: str | os.PathLike[str], comm: Communicator, trusted: TrustSource = None
    ) -> None:
        self.store = open_store(path)
        self.path = location(self.store)
        self.index = read_shared_index(self.store, comm, trusted_keys(trusted))
        reuse.remember_index(self.store, self.index)  # the base of the next save

    def load(self, state: dict[str, Any], comm: Communicator, options: CheckpointOptions) -> Any:
        return load_indexed(state, resolve_run(options, self.store, comm), self.index, comm)


@dataclass
class Found:
    """Where a graph name was found: ``source`` is the checkpoint name read."""

    source: str
    entry: dict[str, Any] | None  # an index entry, or None for a part of a stored value
    value: Any = None


class RestoreSession:
    """The state of one restore (see the module docstring)."""

    def __init__(
        self,
        source: Source,
        comm: Communicator,
        root: Any,
        options: CheckpointOptions,
    ) -> None:
        self.source = source
        self.path = source.path
        self.options = options.replace(strict=False)  # rounds of partial loads
        self.allow_pickle = options.allow_pickle
        self.comm = comm
        self._root = weakref.ref(root)
        self.index = source.index
        variables = dict(self.index["variables"])
        aliases = variables.pop(ALIASES, None)
        self.aliases: dict[str, str] = (
            decode(aliases["value"]) if aliases and aliases.get("kind") == "value" else {}
        )
        self.variables: dict[str, Any] = variables
        self._groups = {a for name in variables for a in ancestors(name)}
        self._decoded: dict[str, Any] = {}
        self.matched: set[str] = set()  # graph names that received a value
        self.used: set[str] = set()  # checkpoint names read
        self.pending: set[str] = set()  # graph names waiting for a lazy module
        self.claimed: set[str] = set()  # graph names already planned: never restored again
        self._unconsumed: list[str] | None = None  # the job's, agreed after each execute
        self.active = True
        self.expect_partial = False
        self._warned = False

    # ------------------------------------------------------------ finding names

    def _value(self, name: str) -> Any:
        if name not in self._decoded:
            self._decoded[name] = decode(
                self.variables[name]["value"], allow_pickle=self.allow_pickle, name=name
            )
        return self._decoded[name]

    def find(self, name: str) -> Found | None:
        """Where the checkpoint holds graph name ``name``: its own entry, the entry it is
        an alias of, or a part of a stored value; None if nowhere."""
        for candidate in (name, self.aliases.get(name)):
            if candidate is not None and candidate in self.variables:
                return Found(candidate, self.variables[candidate])
        for prefix in ancestors(name):
            entry = self.variables.get(prefix)
            if entry is None:
                continue
            if entry.get("kind") != "value":
                return None
            part = descend(self._value(prefix), parts(name[len(prefix) + 1 :]))
            return None if part is MISSING else Found(name, None, part)
        return None

    def has_under(self, name: str) -> bool:
        """Whether the checkpoint holds ``name`` or anything below it."""
        return name in self._groups or self.find(name) is not None

    def tensor_names(self) -> TensorNames:
        root = self._root()
        if root is None:
            raise ReferenceError("the Checkpoint of this restore no longer exists")
        return TensorNames(root)

    # ------------------------------------------------------------ restoring

    def restore_object(self, obj: Any, name: str, parent: Any, key: Any) -> None:
        """Restore ``obj``, just assigned under ``name``, and everything below it; collective.

        Only once per name, as TensorFlow's deferred restores: a name this restore has
        already served (``ckpt.epoch = ckpt.epoch + 1`` after the restore) keeps the new
        object as assigned.
        """
        if name in self.claimed:
            return
        plan = Plan()
        plan_restore(obj, name, parent, key, self, plan)
        self.execute(plan)

    def execute(self, plan: Plan) -> None:
        """Read every slot of ``plan`` the checkpoint holds, then run its finalizers.

        Collective: one :func:`distckpt.load` per round of distinct checkpoint names
        (one round unless a name fills two different targets), plus a check that no rank
        failed before and after reading.
        """
        rounds: list[dict[str, Any]] = [{}]
        ready: list[tuple[Slot, Any]] = []
        error: BaseException | None = None
        try:
            for slot in plan.slots:
                found = self.find(slot.name)
                if found is not None:
                    ready.append((slot, self._schedule(slot, found, rounds)))
                    self.matched.add(slot.name)
                    self.used.add(found.source)
        except Exception as exc:
            error = exc
        raise_if_any_failed(self.comm, error)
        for batch in rounds:
            if batch:
                self.source.load(nest(batch), self.comm, self.options)
        try:
            for slot, holder in ready:
                if slot.on_value is not None:
                    slot.on_value(holder.value if isinstance(holder, PerRank) else holder)
            for finish in plan.finalizers:
                finish()
        except Exception as exc:
            error = exc
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        """Collective, at the end of :meth:`execute`: raise if any rank failed (as
        :func:`~distckpt.comm.raise_if_any_failed`), and agree on the checkpoint names no
        rank has read yet, in the same allgather (:func:`~distckpt.pipeline.matching.gather_left`:
        nothing from a rank that has read all of them)."""
        unconsumed = self._held() if self._unconsumed is None else self._unconsumed
        payload = None if error is None else Failure.capture(error, self.comm.rank)
        failures, agreed = gather_left(self.comm, payload, unconsumed, self._unread(unconsumed))
        failure = first_failure(failures)
        if failure is not None:
            failure.raise_here(self.comm.rank, error)
        self._unconsumed = agreed

    def _schedule(self, slot: Slot, found: Found, rounds: list[dict[str, Any]]) -> Any:
        """What receives the value of ``slot``: the value itself, or a holder to load into."""
        entry = found.entry
        kind = "value" if entry is None else entry.get("kind")
        if kind == "value":
            if slot.target is not None:
                raise ShapeMismatchError(
                    f"variable {slot.name!r} is a tensor in the object graph but a Python value "
                    f"in the checkpoint ({found.source!r})"
                )
            return found.value if entry is None else self._value(found.source)
        assert entry is not None
        if kind == "tensor":
            holder = slot.target
            if holder is None:
                if "pieces" in entry or "chunks" in entry:  # (a local step's are checked there)
                    check_stored(self.source.store, Pieces(entry, found.source))
                shape = tuple(entry["shape"])
                holder = torch.empty(shape, dtype=dtypes.torch_dtype(entry["dtype"]))
        elif kind == "per_rank":
            target = slot.target
            if isinstance(target, Shard) or is_dtensor(target):
                raise ShapeMismatchError(
                    f"variable {slot.name!r} is sharded in the object graph but per-rank in the "
                    f"checkpoint ({found.source!r})"
                )
            holder = PerRank(target)
        else:
            raise CorruptCheckpointError(
                f"{self.path}: variable {found.source!r} has unknown kind {kind!r}"
            )
        for batch in rounds:
            if batch.get(found.source) is holder:
                return holder
            if found.source not in batch:
                batch[found.source] = holder
                return holder
        rounds.append({found.source: holder})
        return holder

    # ------------------------------------------------------------ reporting

    def unused(self) -> list[str]:
        """Checkpoint names that no object of the job's graphs has read (yet), sorted: as
        agreed by the last restore step (no communication); this rank's alone before
        the first one ended."""
        if self._unconsumed is None:
            return self._unread(self._held())
        return list(self._unconsumed)

    def _held(self) -> list[str]:
        """Every name the checkpoint holds, a stored value's parts each, sorted."""
        out = []
        for name, entry in self.variables.items():
            held = [name]
            if entry.get("kind") == "value":
                # pickled and not allowed, or not to be unpickled here: one name
                with contextlib.suppress(Exception):
                    held = list(expand(name, self._value(name)))
            out += held
        return sorted(out)

    def _unread(self, names: list[str]) -> list[str]:
        """Those of ``names`` that no object of this rank's graph has read."""
        used_groups = {a for name in self.used for a in ancestors(name)}
        return [
            n
            for n in names
            if not (n in self.used or n in used_groups or any(a in self.used for a in ancestors(n)))
        ]

    def warn_unresolved(self) -> None:
        """Log, once and on rank 0, the checkpoint values no rank has read, unless the
        status was told ``expect_partial()``."""
        if self._warned or self.expect_partial or not self.active:
            return  # (inactive: the restore failed, and its error said enough)
        self._warned = True
        unused = self.unused()
        if unused and self.comm.rank == 0:
            log.warning(
                "restore of %s: %d value(s) in the checkpoint were not matched to any object: "
                "%s. Call expect_partial() on the restore status to silence this when a "
                "partial restore is intended.",
                self.path,
                len(unused),
                ", ".join(unused),
            )

    def deactivate(self) -> None:
        self.active = False

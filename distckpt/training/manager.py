"""``distckpt.CheckpointManager``: numbered checkpoints in a run directory, as
``tf.train.CheckpointManager``, with the Estimator's time-based schedule.

::

    ckpt = distckpt.Checkpoint(step=torch.tensor(1), optimizer=opt, net=net)
    manager = distckpt.CheckpointManager(ckpt, "run", max_to_keep=3)
    if manager.restore_or_initialize():
        print(f"Restored from {manager.latest_checkpoint}")
    for _ in range(50):
        train_step(); ckpt.step.add_(1)
        if int(ckpt.step) % 10 == 0:
            path = manager.save()          # run/ckpt-1, run/ckpt-2, ...

**State.** Everything the manager knows lives in the directory's ``latest`` pointer
(see :mod:`distckpt.training.pointer`), so a new manager on the same directory (a
restarted job) sees the same list. Next to ``latest`` and ``all`` the pointer carries a
``"manager"`` entry: the commit time of every checkpoint, the checkpoints preserved by
``keep_checkpoint_every_n_hours`` and the time of the last one preserved. A committed
``<name>-N`` that the pointer does not name (a crash between the commit and the pointer
update) is adopted at construction.

**Numbering.** ``N`` is ``checkpoint_number`` when given, else the checkpoint's
``save_counter`` after incrementing it. When ``<name>-N`` already exists (e.g. it was
adopted, or a job restarted from an older checkpoint), the manager never overwrites it:
it takes the next free number and logs it. Auto-numbered saves then continue from that
number (the ``save_counter`` saved with the checkpoint is its ``N``).

**Retention.** Only after the new checkpoint is committed *and* the pointer names the
new list does rank 0 delete what fell out of it: each one is first marked (an owner file
inside it, so :func:`~distckpt.storage.staging.collect_garbage` never restores it),
renamed out of sight to ``<dir>/.<name>.trash-<token>``, then removed. A crash leaves at
worst a trash directory, which ``collect_garbage`` (run by every save and by the
manager's construction) removes.

**Ranks.** Every method is collective: call it on every rank. Decisions that depend on
time (``save_interval_secs``, ``keep_checkpoint_every_n_hours``) and on the directory's
contents are made on rank 0 and broadcast. Only rank 0 writes the pointer, deletes, and
holds the directory's lock (:mod:`distckpt.training.lock`): a manager on the same
directory in another process fails with
:class:`~distckpt.training.lock.DirectoryLockedError`.

**Two tiers.** With ``local=LocalTier(...)`` (see :mod:`distckpt.local`) the saves that
the persistent schedule does not claim go, on their own schedule, to each node's local
storage with replicas on peer nodes; :meth:`CheckpointManager.restore_or_initialize`
restores the newest local step the surviving nodes hold whole when it is newer than the
newest persistent checkpoint, and :attr:`CheckpointManager.restored` says which tier.
Both tiers number their saves from the checkpoint's ``save_counter``.

**Replacing a manager.** Within one process a new manager on a directory (the same
``os.path.realpath``) takes it over from the older one that is still open, as
TensorFlow's guide does for its second run and a notebook cell does when run twice. The
new manager first waits for the older one's background save (a failure there is logged
as a warning, not raised), then the lock passes from the older manager to the new one
without being released in between. From then on the older manager refuses to save, on
every rank, with :class:`~distckpt.training.lock.DirectoryLockedError`; it can still
restore, and its ``close()`` leaves the lock to the new manager. A closed manager is not
replaced: the new one takes the lock as usual.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distckpt.comm import Communicator, auto, raise_if_any_failed
from distckpt.engine import background
from distckpt.engine.background import AsyncSave
from distckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from distckpt.local import LocalTier, files
from distckpt.local.restore import LocalStep, choose
from distckpt.local.save import Step, save_local, topology
from distckpt.storage import codecs
from distckpt.storage import index as index_mod
from distckpt.storage.backend import Store, child_location, is_remote, resolve
from distckpt.storage.codecs import Compression
from distckpt.storage.transaction import collect_garbage, retire, retiring
from distckpt.training.checkpoint import Checkpoint
from distckpt.training.lock import STALE_SECONDS, DirectoryLock, DirectoryLockedError
from distckpt.training.pointer import FORMAT, POINTER_FILE, VERSION, Pointer, move, read_versioned

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "DirectoryLockedError", "Restored"]


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.restore_or_initialize` restored: the ``tier``
    (``"local"`` or ``"persistent"``), the checkpoint ``number`` (the ``N`` of
    ``ckpt-N``, or of the local step), its ``path`` (for a local step, this rank's node
    directory of it) and, in words, ``reason``: why that tier."""

    tier: str
    number: int
    path: str
    reason: str


#: The file of a run directory that holds its identity (see ``_run_identity``).
RUN_FILE = ".distckpt-run"

# This process's newest manager of each directory, by real path, on every rank: the one a
# new manager of that directory takes over from.
_managers: weakref.WeakValueDictionary[str, CheckpointManager] = weakref.WeakValueDictionary()


def _step_value(step: Any) -> int:
    if hasattr(step, "item"):
        return int(step.item())
    return int(step)


def _created(path: Store) -> float | None:
    """When the checkpoint at ``path`` was committed (0.0 when its index does not say, or
    is of a newer format), or None when ``path`` holds no committed checkpoint: one read
    of its index tells both."""
    try:
        index = index_mod.read_index(path)
    except UnsupportedFormatError:
        return 0.0
    except CheckpointNotFoundError:
        return None
    except CorruptCheckpointError as exc:
        log.warning("%s is unreadable, so not restored (left in place): %s", path.url, exc)
        return None
    created = index.get("created")
    return float(created) if isinstance(created, (int, float)) else 0.0


def _manager_meta(meta: Any, where: str) -> dict[str, Any]:
    """The pointer's ``"manager"`` entry, checked: commit times by name (numbers), the
    preserved names and the time of the last one preserved."""
    if meta is None:
        return {}
    times = meta.get("times") if isinstance(meta, dict) else None
    preserved = meta.get("preserved") if isinstance(meta, dict) else None
    last = meta.get("last_preserved") if isinstance(meta, dict) else None
    number = (int, float)
    if (
        not isinstance(meta, dict)
        or not isinstance(times or {}, dict)
        or not all(
            isinstance(v, number) and not isinstance(v, bool) for v in (times or {}).values()
        )
        or not isinstance(preserved or [], list)
        or not all(isinstance(n, str) for n in preserved or [])
        or (last is not None and (not isinstance(last, number) or isinstance(last, bool)))
    ):
        raise CorruptCheckpointError(f"{where}: the manager's entry is malformed")
    return meta


def _schedule_of(extra: dict[str, Any], where: str) -> tuple[int | None, float | None]:
    """The step and time of the last persistent save, as a local step records them."""
    step, when = extra.get("last_persistent_step"), extra.get("last_persistent_time")
    if not (step is None or (type(step) is int and step >= 0)) or not (
        when is None or (type(when) in (int, float) and 0 <= when < math.inf)
    ):
        raise CorruptCheckpointError(f"{where}: the manager's schedule in it is malformed")
    return step, None if when is None else float(when)


class CheckpointManager:
    """Keep the newest ``max_to_keep`` checkpoints of ``checkpoint`` in ``directory``.

    ``max_to_keep`` None keeps every checkpoint. ``keep_checkpoint_every_n_hours``
    additionally preserves, forever, one checkpoint per that many hours (by commit time)
    among those that fall out of the newest ``max_to_keep``; preserved checkpoints stay
    in the pointer's ``all`` but not in :attr:`checkpoints` (as TensorFlow).
    ``checkpoint_interval`` with ``step_counter`` (an int-like or 0-d tensor, read at
    each save) makes :meth:`save` skip until the step advanced by at least that much
    since the last save; ``save_interval_secs`` makes it skip until that many seconds
    passed since the last save (the first save of a manager always happens: the
    Estimator's "save at start"; call ``save(check_interval=False)`` at the end).
    ``directory`` None: rank 0 creates a temporary directory and logs it.
    ``allow_pickle`` is passed to every save and restore (see
    :meth:`~distckpt.training.Checkpoint.save`: only for checkpoints you trust).
    ``compression`` (``"zstd"``, ``"blosc-lz4"`` or name patterns such as
    ``{"optimizer/*": "zstd"}``, see :func:`distckpt.save`) applies to every save the
    manager makes, a preemption's final save included; ``io_workers`` (each rank's I/O
    threads, see :func:`distckpt.save`) to every save and restore.
    ``prepare_async=True`` allocates the host buffers of background saves now, for the
    state that exists (see :meth:`prepare_async`).
    ``local`` (a :class:`~distckpt.LocalTier`) adds the node-local tier: saves between the
    persistent ones go to each node's own storage, copied to peers on other nodes, and
    :meth:`restore_or_initialize` prefers a newer whole local step (see "Two tiers" in
    :mod:`distckpt.training.manager`).
    ``comm`` defaults to :func:`distckpt.comm.auto`; ``clock`` (seconds, default
    ``time.time``) is read on rank 0 only. Collective.

    An open manager of the same directory in this process is replaced: it finishes its
    background save and hands its lock over, and refuses to save from then on (see
    "Replacing a manager" in :mod:`distckpt.training.manager`). One in another process
    makes this raise :class:`~distckpt.training.lock.DirectoryLockedError`.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str] | None,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_interval: int | None = None,
        step_counter: Any = None,
        save_interval_secs: float | None = None,
        checkpoint_name: str = "ckpt",
        *,
        comm: Communicator | None = None,
        clock: Callable[[], float] = time.time,
        lock_stale_seconds: float = STALE_SECONDS,
        allow_pickle: bool = False,
        compression: Compression = None,
        io_workers: int | None = None,
        prepare_async: bool = False,
        local: LocalTier | None = None,
    ) -> None:
        codecs.check(compression)
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"local must be a distckpt.LocalTier, got {type(local).__name__}")
        if local is not None and local.interval is not None and step_counter is None:
            raise ValueError("a LocalTier interval (in steps) needs the manager's step_counter")
        if local is not None and checkpoint_interval is None and save_interval_secs is None:
            log.warning(
                "CheckpointManager: with no checkpoint_interval or save_interval_secs every "
                "save is persistent, so the LocalTier is never saved to"
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs a step_counter")
            if checkpoint_interval < 0:
                raise ValueError(f"checkpoint_interval must be >= 0, got {checkpoint_interval}")
        if not checkpoint_name or "/" in checkpoint_name or checkpoint_name.startswith("."):
            raise ValueError(f"bad checkpoint_name {checkpoint_name!r}")
        self._checkpoint = checkpoint
        self._comm = comm or auto()
        self._clock = clock
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._checkpoint_interval = checkpoint_interval
        self._step_counter = step_counter
        self._save_interval_secs = save_interval_secs
        self._name = checkpoint_name
        self._pattern = re.compile(rf"^{re.escape(checkpoint_name)}-(\d+)$")
        self._last_step: int | None = None
        self._last_save_time: float | None = None
        self._lock: DirectoryLock | None = None
        self._release_when_dropped: weakref.finalize | None = None
        self._closed = False
        self._replaced = False
        self._pending: AsyncSave | None = None
        self._allow_pickle = allow_pickle
        self._compression = compression
        self._io_workers = io_workers
        self._local = local
        self._local_store = None if local is None else resolve(local.path())
        self._last_any_step: int | None = None  # rank 0: the last save of either tier
        self._last_any_time: float | None = None
        self.restored: Restored | None = None
        self._local_reason = ""

        comm = self._comm
        if directory is None:
            made = tempfile.mkdtemp(prefix="distckpt-") if comm.rank == 0 else None
            directory = comm.broadcast(made)
            log.info(
                "CheckpointManager: no directory given; using temporary directory %s", directory
            )
        self._directory = os.fspath(directory)
        self._store = resolve(self._directory)
        self._pointer_version: str | None = None  # rank 0: the pointer as last read or written
        remote = is_remote(self._directory)
        key = self._store.url if remote else os.path.realpath(self._directory)
        older = _managers.get(key)
        if older is not None and older._closed:
            older = None
        if older is not None:
            older._finish_for_successor()

        error: BaseException | None = None
        state: dict[str, Any] | None = None
        handed_over = None if older is None else older._lock_to_hand_over()
        if comm.rank == 0:
            try:
                if handed_over is not None:
                    self._lock = handed_over
                else:
                    self._lock = DirectoryLock(self._store, stale_seconds=lock_stale_seconds)
                    self._lock.acquire()
                collect_garbage(self._store)
                state = self._recover()
                if local is not None:
                    state["run"] = self._run_identity()
            except BaseException as exc:
                error = exc
                if self._lock is not None and self._lock is not handed_over:
                    self._lock.release()
                self._lock = None  # a lock handed over stays with the older manager
        raise_if_any_failed(comm, error)
        if older is not None:
            older._give_way(lock_handed_over=handed_over is not None)
        if self._lock is not None:  # a manager dropped without close() frees its directory
            self._release_when_dropped = weakref.finalize(self, self._lock.release)
        _managers[key] = self
        state = comm.broadcast(state)
        self._run = str(state.pop("run", ""))  # with a local tier: whose local steps count
        self._set_state(state)
        if prepare_async:
            self.prepare_async()

    def prepare_async(self) -> int:
        """Allocate the host buffers that background saves copy into, now (pinned for GPU
        tensors), so the first ``save(async_save=True)`` returns as fast as the later
        ones; returns their bytes. Local. Tensors that do not exist yet (an optimizer's
        state before its first step) get theirs at the first save that has them: call
        this again after the first step to allocate those too."""
        return self._checkpoint.prepare_async()

    def _finish_for_successor(self) -> None:
        """Wait for the background save before a newer manager takes over. Local."""
        try:
            self.sync()
        except Exception as exc:
            log.warning(
                "the background save of the replaced CheckpointManager of %s failed: %s",
                self._directory,
                exc,
            )

    def _lock_to_hand_over(self) -> DirectoryLock | None:
        """This manager's lock (rank 0; None elsewhere), unless another process took it
        over meanwhile."""
        lock = self._lock
        if lock is None or not lock.held:
            return None
        try:
            lock.check()
        except DirectoryLockedError:
            return None  # lost: the successor acquires (and is refused) as usual
        return lock

    def _give_way(self, lock_handed_over: bool) -> None:
        """A newer manager of this directory took over: refuse saves from now on, and
        leave the lock, if handed over, to the newer manager. Every rank."""
        self._replaced = True
        if lock_handed_over:
            if self._release_when_dropped is not None:
                self._release_when_dropped.detach()
            self._lock = self._release_when_dropped = None

    # ------------------------------------------------------------ properties

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the managed checkpoints, oldest first (not the preserved ones)."""
        return [self._path(n) for n in self._managed]

    @property
    def preserved_checkpoints(self) -> list[str]:
        """Paths kept forever by ``keep_checkpoint_every_n_hours``, oldest first."""
        return [self._path(n) for n in self._preserved]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest checkpoint, or None when there is none."""
        names = self._managed or self._preserved
        return self._path(names[-1]) if names else None

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    # ------------------------------------------------------------ state

    def _set_state(self, state: dict[str, Any]) -> None:
        self._managed: list[str] = list(state["managed"])
        self._preserved: list[str] = list(state["preserved"])
        self._times: dict[str, float] = dict(state["times"])
        self._last_preserved: float = float(state["last_preserved"])

    def _state(self) -> dict[str, Any]:
        return {
            "managed": list(self._managed),
            "preserved": list(self._preserved),
            "times": dict(self._times),
            "last_preserved": self._last_preserved,
        }

    def _recover(self) -> dict[str, Any]:
        """Rank 0: read the pointer, adopt committed checkpoints it does not name."""
        directory = self._store
        found = read_versioned(directory)  # validates format and version
        meta: dict[str, Any] = {}
        pointer = None
        if found is not None:
            raw, self._pointer_version = found
            pointer = Pointer.from_doc(raw)
            meta = _manager_meta(raw.get("manager"), directory.where(POINTER_FILE))
        times = {str(k): float(v) for k, v in (meta.get("times") or {}).items()}
        preserved_set = {str(n) for n in meta.get("preserved") or []}

        created: dict[str, float] = {}

        def alive(name: str) -> bool:
            path = directory.child(name)
            when = _created(path)
            if when is None or retiring(path):
                return False
            created[name] = when
            return True

        known = [] if pointer is None else [n for n in pointer.all if alive(n)]
        if pointer is not None and pointer.latest not in pointer.all and alive(pointer.latest):
            known.append(pointer.latest)
        preserved = [n for n in known if n in preserved_set]
        managed = [n for n in known if n not in preserved_set]
        for name in known:
            times.setdefault(name, created[name])

        adopted = []
        for name in directory.list():
            if not self._pattern.match(name) or name in known:
                continue
            path = directory.child(name)
            when = _created(path)
            if when is None:
                continue
            if retiring(path):
                # Marked for deletion by a retention that crashed: finish it.
                self._delete(name)
                continue
            adopted.append(name)
            times[name] = when
        if adopted:
            log.warning(
                "adopting committed checkpoints the pointer does not name: %s", ", ".join(adopted)
            )
            managed = sorted(managed + adopted, key=lambda n: times[n])
        times = {n: t for n, t in times.items() if n in managed or n in preserved}
        last = meta.get("last_preserved")
        state = {
            "managed": managed,
            "preserved": preserved,
            "times": times,
            "last_preserved": float(last) if last is not None else float(self._clock()),
        }
        if adopted or (pointer is not None and known != pointer.all):
            self._write_pointer(state)
        return state

    def _run_identity(self) -> str:
        """Rank 0: this run directory's identity (created once, in ``RUN_FILE``): local
        steps count only for the run that saved them, so a directory removed and made
        anew, or another run's node-local leftovers, are never restored."""
        fresh = secrets.token_hex(16)
        try:
            self._store.put_new(RUN_FILE, fresh.encode())
            return fresh
        except FileExistsError:
            return self._store.read(RUN_FILE).decode().strip()

    def _write_pointer(self, state: dict[str, Any]) -> None:
        names = [*state["preserved"], *state["managed"]]
        if not names:
            return
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "latest": names[-1],
            "all": names,
            "manager": {
                "times": state["times"],
                "preserved": state["preserved"],
                "last_preserved": state["last_preserved"],
            },
        }
        self._pointer_version = move(
            self._store, json.dumps(doc, indent=1).encode(), self._pointer_version
        )

    # ------------------------------------------------------------ saving

    def _decide(self, checkpoint_number: int | None, check_interval: bool) -> dict[str, Any]:
        """Rank 0: whether to save, to which tier, under which name and counter."""
        if self._lock is not None:
            self._lock.check()
        now = float(self._clock())
        step = None if self._step_counter is None else _step_value(self._step_counter)
        counter = self._checkpoint.save_counter + 1
        number = counter if checkpoint_number is None else int(checkpoint_number)
        if check_interval and not self._due(
            step,
            now,
            self._last_step,
            self._last_save_time,
            self._checkpoint_interval,
            self._save_interval_secs,
        ):
            local = self._local
            if local is None or not self._due(
                step,
                now,
                self._last_any_step,
                self._last_any_time,
                local.interval,
                local.interval_secs,
            ):
                return {"save": False}
            token = secrets.token_hex(8)
            return {
                "save": True,
                "tier": "local",
                "number": number,
                "counter": counter,
                "step": step,
                "token": token,
                "now": now,
            }
        taken = {*self._managed, *self._preserved}
        first = number
        while f"{self._name}-{number}" in taken or self._occupied(f"{self._name}-{number}"):
            number += 1
        if number != first:
            log.warning(
                "%s-%d exists; saving as %s-%d instead", self._name, first, self._name, number
            )
            if checkpoint_number is None:
                counter = number
        return {
            "save": True,
            "tier": "persistent",
            "name": f"{self._name}-{number}",
            "counter": counter,
            "step": step,
            "now": now,
        }

    @staticmethod
    def _due(
        step: int | None,
        now: float,
        last_step: int | None,
        last_time: float | None,
        interval: int | None,
        interval_secs: float | None,
    ) -> bool:
        """Whether the schedule (``interval`` steps, ``interval_secs`` seconds since the
        last save) lets a save happen now; the first save always happens."""
        too_few_steps = (
            interval is not None
            and step is not None
            and last_step is not None
            and step - last_step < interval
        )
        too_soon = (
            interval_secs is not None and last_time is not None and now - last_time < interval_secs
        )
        return not (too_few_steps or too_soon)

    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        *,
        async_save: bool = False,
        lazy: bool = False,
    ) -> Any:
        """Save a new numbered checkpoint and apply retention; collective.

        Returns its path, or None when ``checkpoint_interval`` / ``save_interval_secs``
        say it is not time yet (``check_interval=False`` saves regardless).

        ``async_save=True`` returns an :class:`~distckpt.engine.background.AsyncSave`
        (``.path``, ``.wait()``, ``.done()``) once the state is copied to host memory; the
        write, the commit, the ``latest`` pointer and the removal of checkpoints that
        retention drops follow in the background, in that order. ``lazy=True`` also leaves
        parameters and optimizer state to the background copy (see
        :meth:`~distckpt.training.Checkpoint.save`). The manager's list of checkpoints
        changes when the save is settled: by :meth:`sync`, the next save, or a restore.
        """
        if self._closed:
            raise ValueError("this CheckpointManager is closed")
        if self._replaced:
            raise DirectoryLockedError(
                f"this CheckpointManager of {self._directory} was replaced by a newer "
                "CheckpointManager on the same directory in this process; save through the "
                "new one"
            )
        self.sync()
        comm = self._comm
        decision: dict[str, Any] | None = None
        error: BaseException | None = None
        if comm.rank == 0:
            try:
                decision = self._decide(checkpoint_number, check_interval)
                if decision["save"] and decision["tier"] == "persistent":
                    now = float(self._clock())
                    decision["state"], decision["doomed"] = self._retain(decision["name"], now)
            except BaseException as exc:
                error = exc
        raise_if_any_failed(comm, error)
        decision = comm.broadcast(decision)
        assert decision is not None
        if not decision["save"]:
            return None
        if decision["tier"] == "local":
            return self._save_local(decision, async_save, lazy)
        name = decision["name"]
        path = self._path(name)
        checkpoint = self._checkpoint

        def after_commit() -> None:  # rank 0, once the checkpoint is committed
            self._write_pointer(decision["state"])
            for old in decision["doomed"]:  # only now that the pointer no longer names them
                self._delete(old)

        def committed() -> None:
            self._set_state(decision["state"])
            self._last_step = self._last_any_step = decision["step"]
            self._last_save_time = self._last_any_time = decision["state"]["times"][name]

        handle = self._run_save(
            decision,
            lambda: checkpoint._write(
                path,
                comm,
                self._allow_pickle,
                async_save,
                lazy,
                after_commit,
                self._compression,
                self._io_workers,
            ),
            committed,
        )
        return handle if isinstance(handle, AsyncSave) else path

    def _save_local(self, decision: dict[str, Any], async_save: bool, lazy: bool) -> Any:
        """Save to the node-local tier (see :mod:`distckpt.local.save`); collective."""
        assert self._local is not None and self._local_store is not None
        store = self._local_store
        step = Step(
            decision["number"],
            decision["token"],
            self._run,
            self._local.replicas,
            self._local.max_to_keep,
            {"last_persistent_step": self._last_step, "last_persistent_time": self._last_save_time},
        )

        def start() -> Any:
            state, lazy_names = self._checkpoint._to_save(self._allow_pickle, lazy)
            return save_local(
                state,
                store,
                step,
                self._comm,
                allow_pickle=self._allow_pickle,
                async_save=async_save or lazy,
                lazy=lazy_names,
                io_workers=self._io_workers,
            )

        def confirmed() -> None:
            self._last_any_step = decision["step"]
            self._last_any_time = decision["now"]

        handle = self._run_save(decision, start, confirmed)
        return handle if isinstance(handle, AsyncSave) else os.fspath(handle.path)

    def _run_save(
        self, decision: dict[str, Any], start: Callable[[], Any], done: Callable[[], None]
    ) -> Any:
        """Run ``start()`` (a save of either tier, blocking or in the background) with the
        checkpoint's ``save_counter`` set to the decision's; ``done()`` once it succeeded,
        the counter set back if it failed. Returns what ``start`` returned."""
        checkpoint = self._checkpoint
        previous = checkpoint._save_counter
        checkpoint._save_counter = decision["counter"]

        def settle(failure: BaseException | None) -> None:
            if failure is None:
                done()
            elif checkpoint._save_counter == decision["counter"]:
                checkpoint._save_counter = previous

        try:
            handle = start()
        except BaseException as exc:
            settle(exc)
            raise
        if isinstance(handle, AsyncSave):
            handle.add_done_callback(settle)
            self._pending = handle
            return handle
        settle(None)
        return handle

    def sync(self) -> None:
        """Wait for this manager's background save, if any; raise its error. Local."""
        handle, self._pending = self._pending, None
        if handle is not None:
            try:
                handle.wait()
            finally:
                background.finish_pending()

    def _retain(self, name: str, now: float) -> tuple[dict[str, Any], list[str]]:
        """Rank 0: the new list with ``name`` added, and the names that fall out of it."""
        managed = [*self._managed, name]
        preserved = list(self._preserved)
        times = {**self._times, name: now}
        last_preserved = self._last_preserved
        doomed: list[str] = []
        if self._max_to_keep is not None:
            while len(managed) > self._max_to_keep:
                old = managed.pop(0)
                if (
                    self._keep_hours is not None
                    and times[old] - last_preserved >= self._keep_hours * 3600.0
                ):
                    preserved.append(old)
                    last_preserved = times[old]
                else:
                    doomed.append(old)
                    times.pop(old, None)
        state = {
            "managed": managed,
            "preserved": preserved,
            "times": times,
            "last_preserved": last_preserved,
        }
        return state, doomed

    def _path(self, name: str) -> str:
        """The path (or URL) of checkpoint ``name`` of this directory."""
        return child_location(self._directory, name)

    def _occupied(self, name: str) -> bool:
        return self._store.is_dir(name) or self._store.exists(name)

    def _delete(self, name: str) -> None:
        """Rank 0: delete the checkpoint ``name`` so that no reader sees half of it."""
        try:
            retire(self._store.child(name))
        except OSError as exc:
            log.warning("could not retire checkpoint %s: %s", self._store.where(name), exc)

    # ------------------------------------------------------------ restoring

    def restore_or_initialize(self) -> str | None:
        """Restore the newest checkpoint and return its path, or return None; collective.

        With a :class:`~distckpt.LocalTier`, the newest local step that the surviving
        nodes hold whole (originals plus replicas) is restored when it is newer than the
        newest persistent checkpoint, on any world size; else the persistent one. If the
        local restore fails (a piece fails its checksum, a peer is lost) the persistent
        checkpoint is restored instead, and when there is none the error is raised.
        :attr:`restored` says which and why; for a local step the path returned is this
        rank's node directory of it. Local steps newer than the one restored belong to a
        timeline the job left: they are removed.
        """
        self.sync()
        path = self.latest_checkpoint
        number = None if path is None else self._number(path)
        reason = "no local tier" if self._local is None else ""
        failure: BaseException | None = None
        if self._local is not None:
            restored, failure = self._restore_local(number)
            if restored is not None:
                self.restored = restored
                self._after_restore(restored.number)
                return restored.path
            reason = self._local_reason
        if path is None:
            if failure is not None:  # never go on from a half-restored state
                raise failure
            self.restored = None
            self._after_restore(None)
            return None
        self._checkpoint.restore(
            path, self._comm, allow_pickle=self._allow_pickle, io_workers=self._io_workers
        )
        assert number is not None
        self.restored = Restored("persistent", number, path, reason)
        if self._local is not None and self._comm.rank == 0:
            log.info("restored %s from the shared directory: %s", path, reason)
        self._after_restore(number)
        return path

    def _number(self, path: str) -> int:
        match = self._pattern.match(os.path.basename(path.rstrip("/")))
        return int(match.group(1)) if match else 0

    def _restore_local(
        self, newer_than: int | None
    ) -> tuple[Restored | None, BaseException | None]:
        """Collective: restore the newest whole local step newer than ``newer_than``, or
        restore nothing (the reason in ``self._local_reason``) and return the error of a
        local restore that failed, if one did."""
        assert self._local is not None and self._local_store is not None
        comm = self._comm
        survey = choose(comm, self._local_store, self._run, newer_than)
        self._local_reason = survey.reason
        choice = survey.choice
        if choice is None:
            return None, None
        reason = survey.reason
        if choice.world != comm.size:
            reason += f"; saved on {choice.world} ranks, resharded onto {comm.size}"
        try:
            step = LocalStep.open(self._local_store, choice, comm)
            last_step, last_time = _schedule_of(step.extra, step.path)
            self._checkpoint._restore_from(
                step, comm, allow_pickle=self._allow_pickle, io_workers=self._io_workers
            )
        except Exception as exc:
            self._local_reason = f"restoring local step {choice.step} failed ({exc})"
            if comm.rank == 0:
                log.warning("%s; falling back to the shared directory", self._local_reason)
            return None, exc
        if comm.rank == 0:
            log.info("restored local step %d from the node-local tier: %s", choice.step, reason)
        # The persistent schedule goes on from the last persistent save, not from here.
        self._last_step, self._last_save_time = last_step, last_time
        where = self._local_store.where(files.step_dir(choice.step))
        return Restored("local", choice.step, where, reason), None

    def _after_restore(self, number: int | None) -> None:
        """Every rank: note the restored step for the schedules; with a local tier, the
        lowest rank of each node removes its steps newer than ``number`` (collective)."""
        if number is not None and self._step_counter is not None:
            self._last_any_step = _step_value(self._step_counter)
            if self.restored is not None and self.restored.tier == "persistent":
                self._last_step = self._last_any_step
        if self._local is None or self._local_store is None:
            return
        if topology(self._comm).leader(self._comm.rank):
            files.drop_newer(self._local_store, -1 if number is None else number)

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Wait for a background save, then release the directory's lock (rank 0).

        Idempotent. Raises the background save's error, if it failed unseen. A manager
        replaced by a newer one no longer holds the lock and leaves it alone.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.sync()
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self._directory!r}, max_to_keep={self._max_to_keep}, "
            f"checkpoints={self._managed})"
        )

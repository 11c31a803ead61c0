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

The parts: :mod:`distckpt.training.schedule` (when to save, to which tier),
:mod:`distckpt.training.retention` (which checkpoints stay, the ``latest`` pointer that
lists them, adoption of checkpoints it does not name) and :mod:`distckpt.training.tiers`
(the node-local tier). This module holds them together, with the directory's lock.

**Numbering.** ``N`` is ``checkpoint_number`` when given, else the checkpoint's
``save_counter`` after incrementing it. When ``<name>-N`` already exists (e.g. it was
adopted, or a job restarted from an older checkpoint), the manager never overwrites it:
it takes the next free number and logs it. Auto-numbered saves then continue from that
number (the ``save_counter`` saved with the checkpoint is its ``N``).

**Ranks.** Every method is collective: call it on every rank. Decisions that depend on
time (``save_interval_secs``, ``keep_checkpoint_every_n_hours``) and on the directory's
contents are made on rank 0 and broadcast. Only rank 0 writes the pointer, deletes, and
holds the directory's lock (:mod:`distckpt.training.lock`): a manager on the same
directory in another process fails with
:class:`~distckpt.training.lock.DirectoryLockedError`.

**Owning the directory.** One manager at a time: rank 0 holds the directory's lock,
and a new manager of the same directory in this process takes it over from the older one
(see :mod:`distckpt.training.ownership`).
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distckpt.comm import Communicator, auto
from distckpt.comm.outcome import announce
from distckpt.commit.transaction import collect_garbage
from distckpt.errors import DirectoryLockedError
from distckpt.local import LocalTier
from distckpt.pipeline import background
from distckpt.pipeline.background import AsyncSave
from distckpt.pipeline.options import MANAGER, CheckpointOptions, ManagerKeywords, merge
from distckpt.pipeline.results import SaveResult
from distckpt.storage.registry import is_remote, open_store
from distckpt.training.checkpoint import Checkpoint
from distckpt.training.lock import STALE_SECONDS
from distckpt.training.ownership import Ownership
from distckpt.training.retention import Deletions, Retention
from distckpt.training.schedule import LOCAL, PERSISTENT, Schedule
from distckpt.training.tiers import LocalSaves, Restored, run_identity

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "DirectoryLockedError", "Restored"]


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

    ``options`` (a :class:`~distckpt.CheckpointOptions`) applies to every save and
    restore the manager makes, a preemption's final save included; its fields
    ``compression`` (``"zstd"``, ``"blosc-zstd"``, ``"blosc-lz4"`` or name patterns such as
    ``{"optimizer/*": "zstd"}``, see :func:`distckpt.save`), ``small_bytes``,
    ``inner_bytes``, ``allow_pickle`` (only for checkpoints you trust) and ``io_workers``
    may also be given as keyword arguments, which win.
    ``prepare_async=True`` allocates the host buffers of background saves now, for the
    state that exists (see :meth:`prepare_async`).
    ``local`` (a :class:`~distckpt.LocalTier`) adds the node-local tier: saves between the
    persistent ones go to each node's own storage, copied to peers on other nodes, and
    :meth:`restore_or_initialize` prefers a newer whole local step (see
    :mod:`distckpt.training.tiers`).
    ``delete_in_background=True`` takes the deletion of checkpoints that fall out of the
    list off the save path: the save still withdraws each of them (marks it and renames
    it out of sight, or deletes its index on an object store: it is never listed,
    adopted or restored again), and a thread of rank 0 removes the rest while training
    goes on; :meth:`sync` (which the next save, a restore and :meth:`close` call) waits
    for it. A removal cut short (a crash) leaves a leftover that the next save's garbage
    collection finishes.
    ``comm`` defaults to :func:`distckpt.comm.auto`; ``clock`` (seconds, default
    ``time.time``) is read on rank 0 only. Collective.

    An open manager of the same directory in this process is replaced: it finishes its
    background save and hands its lock over, and refuses to save from then on (see
    :mod:`distckpt.training.ownership`). One in another process makes this raise
    :class:`~distckpt.errors.DirectoryLockedError`.
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
        options: CheckpointOptions | None = None,
        prepare_async: bool = False,
        local: LocalTier | None = None,
        delete_in_background: bool = False,
        **keywords: Unpack[ManagerKeywords],
    ) -> None:
        self._options = merge(options, keywords, MANAGER, "CheckpointManager")
        if local is not None and not isinstance(local, LocalTier):
            raise TypeError(f"local must be a distckpt.LocalTier, got {type(local).__name__}")
        self._schedule = Schedule(
            checkpoint_interval,
            save_interval_secs,
            step_counter,
            None if local is None else local.interval,
            None if local is None else local.interval_secs,
            has_local=local is not None,
        )
        if local is not None and self._schedule.persistent_only:
            log.warning(
                "CheckpointManager: with no checkpoint_interval or save_interval_secs every "
                "save is persistent, so the LocalTier is never saved to"
            )
        self._checkpoint = checkpoint
        self._comm = comm or auto()
        self._clock = clock
        self._closed = False
        self._pending: AsyncSave | None = None
        self._deletions = Deletions() if delete_in_background else None
        self._local: LocalSaves | None = None
        self.restored: Restored | None = None
        #: This rank's :class:`~distckpt.SaveResult` of the last save that succeeded
        #: (bytes written, and reused by an incremental save; seconds per phase).
        self.last_result: SaveResult | None = None

        comm = self._comm
        if directory is None:
            made = tempfile.mkdtemp(prefix="distckpt-") if comm.rank == 0 else None
            directory = comm.broadcast(made)
            log.info(
                "CheckpointManager: no directory given; using temporary directory %s", directory
            )
        self._directory = os.fspath(directory)
        store = open_store(self._directory)
        self._kept = Retention(
            store,
            self._directory,
            checkpoint_name,
            max_to_keep,
            keep_checkpoint_every_n_hours,
            clock,
        )
        key = store.url if is_remote(self._directory) else os.path.realpath(self._directory)
        self._own = Ownership(key, self)
        older = self._own.predecessor()
        if older is not None:
            older.successor_waits()

        handed_over = None if older is None else older.lock_to_hand_over()

        def start() -> dict[str, Any]:  # rank 0
            try:
                self._own.acquire(store, lock_stale_seconds, handed_over)
                collect_garbage(store)
                state = self._kept.recover()
                if local is not None:
                    state["run"] = run_identity(store)
                return state
            except BaseException:
                self._own.abandon(handed_over)
                raise

        state = announce(comm, start)
        self._own.take_over(older, handed_over)
        run = str(state.pop("run", ""))  # with a local tier: whose local steps count
        if local is not None:
            self._local = LocalSaves(local, comm, run)
        self._kept.set_state(state)
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

    # ------------------------------------------------------------ properties

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the managed checkpoints, oldest first (not the preserved ones)."""
        return [self._kept.path(n) for n in self._kept.managed]

    @property
    def preserved_checkpoints(self) -> list[str]:
        """Paths kept forever by ``keep_checkpoint_every_n_hours``, oldest first."""
        return [self._kept.path(n) for n in self._kept.preserved]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest checkpoint, or None when there is none."""
        return self._kept.latest()

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def step_counter(self) -> Any:
        """The step counter the schedule reads (None without one)."""
        return self._schedule.step_counter

    @property
    def comm(self) -> Communicator:
        return self._comm

    @property
    def options(self) -> CheckpointOptions:
        """The options of this manager's saves and restores."""
        return self._options

    # ------------------------------------------------------------ saving

    def _decide(self, checkpoint_number: int | None, check_interval: bool) -> dict[str, Any]:
        """Rank 0: whether to save, to which tier, under which name and counter; for a
        persistent save, the list it makes and the checkpoints that fall out of it."""
        self._own.check_lock()
        now = float(self._clock())
        step = self._schedule.step()
        counter = self._checkpoint.save_counter + 1
        number = counter if checkpoint_number is None else int(checkpoint_number)
        tier = self._schedule.tier(step, now, check_interval)
        if tier is None:
            return {"save": False}
        decision = {"save": True, "tier": tier, "counter": counter, "step": step, "now": now}
        if tier == LOCAL:
            return {**decision, "number": number, "token": secrets.token_hex(8)}
        name, taken = self._kept.free_name(number)
        if taken != number and checkpoint_number is None:
            decision["counter"] = taken
        state, doomed = self._kept.retain(name, float(self._clock()))
        return {**decision, "name": name, "state": state, "doomed": doomed}

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

        ``async_save=True`` returns an :class:`~distckpt.pipeline.background.AsyncSave`
        (``.path``, ``.wait()``, ``.done()``) once the state is copied to host memory; the
        write, the commit, the ``latest`` pointer and the removal of checkpoints that
        retention drops follow in the background, in that order. ``lazy=True`` also leaves
        parameters and optimizer state to the background copy (see
        :meth:`~distckpt.training.Checkpoint.save`). The manager's list of checkpoints
        changes when the save is settled: by :meth:`sync`, the next save, or a restore.
        """
        if self._closed:
            raise ValueError("this CheckpointManager is closed")
        self._own.refuse_if_replaced(self._directory)
        self.sync()
        comm = self._comm
        decision = announce(comm, self._decide, checkpoint_number, check_interval)
        if not decision["save"]:
            return None
        schedule, checkpoint = self._schedule, self._checkpoint
        if decision["tier"] == LOCAL:
            local = self._local
            assert local is not None
            handle = self._run_save(
                decision,
                lambda: local.save(
                    checkpoint,
                    decision["number"],
                    decision["token"],
                    schedule,
                    self._options,
                    async_save,
                    lazy,
                ),
                lambda: schedule.saved(LOCAL, decision["step"], decision["now"]),
            )
            return handle if isinstance(handle, AsyncSave) else os.fspath(handle.path)
        name = decision["name"]
        path = self._kept.path(name)
        base = self.latest_checkpoint  # an incremental save builds on it

        def after_commit() -> None:  # rank 0, once the checkpoint is committed
            self._kept.write_pointer(decision["state"])
            # Only now that the pointer no longer names them: out of sight at once, the
            # rest of each deletion here or in the background.
            rests = [self._kept.withdraw(old) for old in decision["doomed"]]
            if self._deletions is not None:
                self._deletions.start(rests)
            else:
                for rest in rests:
                    rest()

        def committed() -> None:
            self._kept.set_state(decision["state"])
            schedule.saved(PERSISTENT, decision["step"], decision["state"]["times"][name])

        handle = self._run_save(
            decision,
            lambda: checkpoint._write(
                path, comm, self._options, async_save, lazy, after_commit, base
            ),
            committed,
        )
        return handle if isinstance(handle, AsyncSave) else path

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
                result = handle._result if isinstance(handle, AsyncSave) else handle
                if isinstance(result, SaveResult):
                    self.last_result = result
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
        """Wait for this manager's background save, if any, and raise its error; then for
        the deletions of ``delete_in_background`` (which never raise). Local."""
        handle, self._pending = self._pending, None
        try:
            if handle is not None:
                try:
                    handle.wait()
                finally:
                    background.finish_pending()
        finally:
            if self._deletions is not None:
                self._deletions.wait()

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
        number = None if path is None else self._kept.number(path)
        reason = "no local tier"
        failure: BaseException | None = None
        if self._local is not None:
            restored, failure = self._local.restore(
                self._checkpoint, number, self._options, self._schedule
            )
            if restored is not None:
                self.restored = restored
                self._local.drop_newer(restored.number)
                return restored.path
            reason = self._local.reason
        if path is None:
            if failure is not None:  # never go on from a half-restored state
                raise failure
            self.restored = None
            if self._local is not None:
                self._local.drop_newer(None)
            return None
        self._checkpoint.restore(path, self._comm, options=self._options)
        assert number is not None
        self.restored = Restored(PERSISTENT, number, path, reason)
        self._schedule.restored(PERSISTENT, None)
        if self._local is not None:
            if self._comm.rank == 0:
                log.info("restored %s from the shared directory: %s", path, reason)
            self._local.drop_newer(number)
        return path

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
            if self._deletions is not None:
                self._deletions.close()
            self._own.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self._directory!r}, max_to_keep={self._kept.max_to_keep}, "
            f"checkpoints={self._kept.managed})"
        )

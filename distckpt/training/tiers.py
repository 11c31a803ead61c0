"""The node-local tier as a :class:`~distckpt.CheckpointManager` uses it.

With ``local=LocalTier(...)`` (see :mod:`distckpt.local`) the saves that the persistent
schedule does not claim go, on their own schedule (:mod:`distckpt.training.schedule`), to
each node's local storage with replicas on peer nodes;
:meth:`~distckpt.CheckpointManager.restore_or_initialize` restores the newest local step
the surviving nodes hold whole when it is newer than the newest persistent checkpoint, and
:attr:`~distckpt.CheckpointManager.restored` says which tier (:class:`Restored`). Both
tiers number their saves from the checkpoint's ``save_counter``.

Local steps count only for the run that saved them: the run directory holds an identity
(:data:`RUN_FILE`, made once), recorded in every local step, so a directory removed and
made anew, or another run's leftovers on a node, are never restored.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from distckpt.comm import Communicator
from distckpt.local import LocalTier, files
from distckpt.local.choose import choose
from distckpt.local.nodes import topology
from distckpt.local.restore import LocalStep
from distckpt.local.save import Step, save_local
from distckpt.pipeline.options import CheckpointOptions
from distckpt.signing.keys import requires_signature
from distckpt.storage.backend import Store
from distckpt.storage.registry import open_store
from distckpt.training.checkpoint import Checkpoint
from distckpt.training.schedule import Schedule

log = logging.getLogger("distckpt.training.manager")

#: The file of a run directory that holds its identity.
RUN_FILE = ".distckpt-run"


@dataclass(frozen=True)
class Restored:
    """What :meth:`~distckpt.CheckpointManager.restore_or_initialize` restored: the
    ``tier`` (``"local"`` or ``"persistent"``), the checkpoint ``number`` (the ``N`` of
    ``ckpt-N``, or of the local step), its ``path`` (for a local step, this rank's node
    directory of it) and, in words, ``reason``: why that tier."""

    tier: str
    number: int
    path: str
    reason: str


def run_identity(store: Store) -> str:
    """Rank 0: the identity of the run directory ``store`` (created the first time)."""
    fresh = secrets.token_hex(16)
    try:
        store.put_new(RUN_FILE, fresh.encode())
        return fresh
    except FileExistsError:
        return store.read(RUN_FILE).decode().strip()


class LocalSaves:
    """The local tier of one manager: where its steps go, and how they come back."""

    def __init__(self, tier: LocalTier, comm: Communicator, run: str) -> None:
        if not isinstance(tier, LocalTier):
            raise TypeError(f"local must be a distckpt.LocalTier, got {type(tier).__name__}")
        self.tier = tier
        self.comm = comm
        self.run = run
        self.store = open_store(tier.path())
        self.reason = ""  # why the last restore did or did not take a local step

    def save(
        self,
        checkpoint: Checkpoint,
        number: int,
        token: str,
        schedule: Schedule,
        options: CheckpointOptions,
        async_save: bool,
        lazy: bool,
    ) -> Any:
        """Save the checkpoint's state as local step ``number``; collective (see
        :func:`distckpt.local.save.save_local`)."""
        step = Step(
            number,
            token,
            self.run,
            self.tier.replicas,
            self.tier.max_to_keep,
            schedule.record(),
        )
        state, lazy_names = checkpoint._to_save(options.allow_pickle, lazy)
        return save_local(
            state,
            self.store,
            step,
            self.comm,
            options,
            async_save=async_save or lazy,
            lazy=lazy_names,
        )

    def restore(
        self,
        checkpoint: Checkpoint,
        newer_than: int | None,
        options: CheckpointOptions,
        schedule: Schedule,
    ) -> tuple[Restored | None, BaseException | None]:
        """Collective: restore the newest whole local step newer than ``newer_than`` (and
        the persistent schedule it recorded), or restore nothing (the reason in
        :attr:`reason`) and return the error of a local restore that failed, if one did."""
        comm = self.comm
        if requires_signature(options.trusted_keys):
            # Local steps carry no signature: a job that requires one restores from the
            # shared directory, whose checkpoints are checked against the trusted keys.
            self.reason = "local steps are not signed, and trusted keys are required"
            return None, None
        survey = choose(comm, self.store, self.run, newer_than)
        self.reason = survey.reason
        choice = survey.choice
        if choice is None:
            return None, None
        reason = survey.reason
        if choice.world != comm.size:
            reason += f"; saved on {choice.world} ranks, resharded onto {comm.size}"
        try:
            step = LocalStep.open(self.store, choice, comm)
            record = Schedule.read_record(step.extra, step.path)
            checkpoint._restore_from(step, comm, options)
        except Exception as exc:
            self.reason = f"restoring local step {choice.step} failed ({exc})"
            if comm.rank == 0:
                log.warning("%s; falling back to the shared directory", self.reason)
            return None, exc
        if comm.rank == 0:
            log.info("restored local step %d from the node-local tier: %s", choice.step, reason)
        # The persistent schedule goes on from the last persistent save, not from here.
        schedule.restored("local", record)
        where = self.store.where(files.step_dir(choice.step))
        return Restored("local", choice.step, where, reason), None

    def drop_newer(self, number: int | None) -> None:
        """Collective: the lowest rank of each node removes its steps newer than
        ``number`` (a timeline the job left)."""
        if topology(self.comm).leader(self.comm.rank):
            files.drop_newer(self.store, -1 if number is None else number)

"""Preemption: a signal becomes a final checkpoint at the next step boundary, on every rank.

Clusters announce a preemption or the end of a time slot with a signal: SLURM sends
``SIGTERM`` (or, with ``--signal=B:USR1@60``, ``SIGUSR1`` to the batch script, which
forwards it), torchrun forwards the ``SIGTERM`` it receives to its workers. Often only
some ranks receive it. :class:`PreemptionHandler` installs handlers that only raise a flag;
at every step boundary :meth:`PreemptionHandler.save_if_preempted` asks all ranks whether
any of them saw a signal (one small collective), and if so every rank makes the same final,
synchronous save::

    with distckpt.PreemptionHandler(manager) as preemption:
        for batch in data:
            train_step(batch)
            manager.save()                        # the usual schedule
            if preemption.save_if_preempted():    # every rank, every step
                break
    teardown()
    preemption.exit_if_preempted()                # exit code EXIT_PREEMPTED (75)

The process then exits with :data:`EXIT_PREEMPTED`, which launch scripts turn into a
requeue or a relaunch. Launchers do not always pass a worker's exit code on (torchrun
reports 1 for any failure), so when ``$DISTCKPT_PREEMPTED_FILE`` is set, rank 0 also
writes that file (JSON: step, checkpoint, signal) once the final checkpoint is committed.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from distckpt import settings
from distckpt.storage.fsutil import atomic_write

if TYPE_CHECKING:
    from distckpt.training.manager import CheckpointManager

log = logging.getLogger("distckpt")

#: Exit code of a process that saved and stopped because of a preemption (EX_TEMPFAIL).
EXIT_PREEMPTED = 75


#: The signals a :class:`PreemptionHandler` handles unless given others.
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Turn ``signals`` on any rank into one final checkpoint of ``manager`` on every rank.

    Handlers are installed by :meth:`install` (or ``with``) on the main thread, and the
    previous ones are put back by :meth:`uninstall`. A signal only sets a flag: nothing runs
    inside the signal handler, so a signal in the middle of a step or a save is safe.

    :param manager: the :class:`~distckpt.training.CheckpointManager` that saves.
    :param signals: the signals that mean "preempted" (default ``SIGTERM`` and ``SIGUSR1``).
    :param exit_code: what :meth:`exit_if_preempted` exits with (default
        :data:`EXIT_PREEMPTED`).
    :param check_every: ask the other ranks every this many calls of
        :meth:`save_if_preempted` (1: every step). A signal is acted on within
        ``check_every`` steps.
    :param step_counter: an int-like or 0-d tensor holding the training step, recorded in
        the marker file; the manager's ``step_counter`` if None.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        signals: tuple[int, ...] = DEFAULT_SIGNALS,
        exit_code: int = EXIT_PREEMPTED,
        check_every: int = 1,
        step_counter: Any = None,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every must be at least 1, got {check_every}")
        self.manager = manager
        self.signals = tuple(signals)
        self.exit_code = exit_code
        self.check_every = check_every
        self.step_counter = step_counter if step_counter is not None else manager.step_counter
        self.received: int | None = None  # the first signal this rank received
        self.preempted = False  # set on every rank once the ranks agreed
        self.checkpoint: str | None = None
        self._calls = 0
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------ signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def install(self) -> PreemptionHandler:
        """Install the signal handlers (main thread only); returns self."""
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back; once preempted, ignore the signals instead.

        Launchers and cluster managers often deliver one notice several times (to each
        process directly and again through each forwarding layer): a late copy must not
        kill a process that saved and is exiting with :attr:`exit_code`.
        """
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.preempted else previous)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ------------------------------------------------------------ step boundary

    def save_if_preempted(self) -> bool:
        """Collective, at a step boundary: if any rank got a signal, save and return True.

        Every rank must call it at the same steps. When a preemption is agreed, a pending
        background save is finished, a final checkpoint is saved synchronously (whatever the
        manager's interval), rank 0 writes ``$DISTCKPT_PREEMPTED_FILE`` if that is set, and
        every rank returns True; leave the training loop then and call
        :meth:`exit_if_preempted`. Returns False otherwise (also on calls that skip the
        check, see ``check_every``) and True again once preempted.
        """
        if self.preempted:
            return True
        self._calls += 1
        if self._calls % self.check_every:
            return False
        comm = self.manager.comm
        seen = comm.allgather(self.received)
        signals = [s for s in seen if s is not None]
        if not signals:
            return False
        self.preempted = True
        name = signal.Signals(signals[0]).name
        ranks = [r for r, s in enumerate(seen) if s is not None]
        t0 = time.perf_counter()
        self.manager.sync()
        self.checkpoint = self.manager.save(check_interval=False)
        if comm.rank == 0:
            log.warning(
                "preempted (%s on rank(s) %s): saved %s in %.2fs",
                name,
                ranks,
                self.checkpoint,
                time.perf_counter() - t0,
            )
            marker = settings.PREEMPTED_FILE.get()
            if marker:
                step = None if self.step_counter is None else int(self.step_counter)
                doc = {"step": step, "checkpoint": self.checkpoint, "signal": name}
                atomic_write(marker, json.dumps(doc).encode())
        return True

    def exit_if_preempted(self) -> None:
        """Exit the process with :attr:`exit_code` if a preemption was saved; else return."""
        if self.preempted:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            raise SystemExit(self.exit_code)

"""A communicator over MPI (mpi4py), for jobs started by ``mpiexec``/``mpirun``/``srun``.

Every collective is preceded by a nonblocking barrier (``Ibarrier``) that is polled until
the communicator's deadline: a rank that died, or never reaches the same collective,
makes the others raise :class:`~distckpt.errors.CommTimeoutError` instead of blocking
forever. Once that barrier completed, every rank is known to be alive and inside the
same collective, and the (blocking) mpi4py collective proceeds. A rank that dies
*during* the data transfer itself is left to MPI (with MPICH/hydra and Open MPI the
launcher then ends the whole job).

``mpi4py.MPI`` is imported when an :class:`MPIComm` is constructed, never at import of
this module: importing it initializes MPI.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import time
from typing import Any

from distckpt.comm.base import resolve_timeout
from distckpt.errors import CommTimeoutError

logger = logging.getLogger(__name__)

#: First and longest sleep, in seconds, between two polls of the barrier request.
_POLL_FIRST = 50e-6
_POLL_MAX = 0.01


_abort_registered = False

#: The tag of :meth:`MPIComm.sendrecv`'s messages, and its longest sleep between polls
#: (short: MPI moves large messages only while they are tested).
_P2P_TAG = 7117
_P2P_POLL_MAX = 0.001

#: Background communicators already created: Fortran handle of the communicator -> dup.
_BACKGROUND: dict[int, MPIComm] = {}

#: Communicators split off before: (Fortran handle, every rank's color) -> this rank's.
_SPLITS: dict[tuple[int, tuple[int, ...]], MPIComm | None] = {}


def _abort_at_exit() -> None:
    """At interpreter exit, abort the MPI job rather than wait in MPI_Finalize (once)."""
    global _abort_registered
    if _abort_registered:
        return
    _abort_registered = True

    def abort() -> None:
        logger.error("distckpt: a collective timed out earlier; aborting the MPI job")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

    # runs before mpi4py's MPI_Finalize: mpi4py registered its hook at import of
    # mpi4py.MPI, earlier, and hooks run last-in first-out (checked with mpi4py 4.1)
    atexit.register(abort)


class MPIComm:
    """A :class:`~distckpt.comm.base.Communicator` over an mpi4py communicator.

    Construction is local (not a collective). After a time-out the communicator is
    unusable: a barrier request is left pending, and every later call raises
    :class:`~distckpt.errors.CommTimeoutError` at once.

    :param comm: an ``mpi4py.MPI.Comm`` (an intracommunicator); ``MPI.COMM_WORLD`` if
        None. It is used as is, not duplicated: its collectives and distckpt's must be
        called in the same order on every rank, as always with MPI.
    :param timeout: seconds a collective waits for every rank to arrive; None means
        ``$DISTCKPT_TIMEOUT`` or :data:`~distckpt.comm.base.DEFAULT_TIMEOUT`.
    :param abort_at_exit: after a time-out, end the whole MPI job (``MPI_Abort``) when
        this process exits, instead of letting ``MPI_Finalize`` wait for the missing rank
        (MPICH's does, for ever if that rank hangs). The error can still be caught and
        handled; only the process's exit is affected.
    """

    def __init__(
        self, comm: Any = None, timeout: float | None = None, *, abort_at_exit: bool = True
    ) -> None:
        from mpi4py import MPI  # lazily: importing mpi4py.MPI initializes MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        #: This process's rank in ``comm``.
        self.rank: int = self.comm.Get_rank()
        #: The size of ``comm``.
        self.size: int = self.comm.Get_size()
        #: ``timeout``, else ``$DISTCKPT_TIMEOUT``, else
        #: :data:`~distckpt.comm.DEFAULT_TIMEOUT`.
        self.timeout = resolve_timeout(timeout)
        self.abort_at_exit = abort_at_exit
        self._broken: str | None = None

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size}, timeout={self.timeout})"

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is out of range for a communicator of size {self.size}")

    def _arrive(self, op: str) -> None:
        """Wait (at most ``timeout`` seconds) until every rank has entered collective ``op``.

        Called by every rank, before each collective.
        """
        if self._broken is not None:
            raise CommTimeoutError(self._broken)
        if self.size == 1:
            return
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout
        delay = _POLL_FIRST
        while not request.Test():
            if time.monotonic() >= deadline:
                self._broken = (
                    f"MPI {op} on rank {self.rank} of {self.size}: not every rank arrived "
                    f"within {self.timeout:g} s (a rank died, hangs, or called another "
                    "collective); this communicator is no longer usable"
                )
                logger.debug("%s", self._broken)
                if self.abort_at_exit:
                    _abort_at_exit()
                raise CommTimeoutError(self._broken)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)

    def background(self) -> MPIComm:
        """Collective at first use: the communicator of distckpt's background thread.

        An MPIComm over ``MPI_Comm_dup`` of this one, created on the first call and cached
        per underlying communicator. Its messages never match this communicator's, so a
        background thread runs collectives on it while the training thread uses this
        one. That needs MPI initialized with ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
        """
        from mpi4py import MPI

        key = self.comm.py2f()
        if key in _BACKGROUND:
            return _BACKGROUND[key]
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "a background save needs MPI_THREAD_MULTIPLE, but MPI was initialized with "
                f"thread level {MPI.Query_thread()}; leave mpi4py.rc.thread_level at its "
                "default ('multiple') or save with async_save=False"
            )
        self._arrive("background")
        dup = MPIComm(self.comm.Dup(), self.timeout, abort_at_exit=self.abort_at_exit)
        _BACKGROUND[key] = dup
        return dup

    def split(self, color: int) -> MPIComm | None:
        """Collective: the communicator of the ranks that pass the same ``color`` (ranks
        in this one's order); None for a negative color. Cached per colors, so a job
        restoring the same way again splits once."""
        from mpi4py import MPI

        colors = tuple(self.allgather(int(color)))
        key = (self.comm.py2f(), colors)
        if key not in _SPLITS:
            self._arrive("split")
            sub = self.comm.Split(color if color >= 0 else MPI.UNDEFINED, self.rank)
            _SPLITS[key] = (
                None
                if sub == MPI.COMM_NULL
                else MPIComm(sub, self.timeout, abort_at_exit=self.abort_at_exit)
            )
        return _SPLITS[key]

    def broadcast_array(self, array: Any, root: int = 0) -> None:
        """Collective: fill ``array`` (a contiguous NumPy array, the same size on every
        rank) with ``root``'s, in place."""
        self._check_root(root)
        self._arrive("broadcast_array")
        self.comm.Bcast(array, root=root)

    def sendrecv(self, sends: list[tuple[int, Any]], recvs: list[tuple[int, Any]]) -> None:
        """Collective: send each ``(peer, array)`` of ``sends`` and fill each ``(peer,
        array)`` of ``recvs`` (contiguous NumPy byte arrays, at most one of each per peer,
        sized alike on both ends) at once; returns when all are done."""
        from mpi4py import MPI

        self._arrive("sendrecv")
        requests = [self.comm.Isend(array, dest=peer, tag=_P2P_TAG) for peer, array in sends]
        requests += [self.comm.Irecv(array, source=peer, tag=_P2P_TAG) for peer, array in recvs]
        # Polled (MPI progresses the transfers while tested), so that a peer that dies in
        # the middle of a transfer makes this raise after ``timeout`` instead of hanging.
        deadline = time.monotonic() + self.timeout
        delay = _POLL_FIRST
        while not MPI.Request.Testall(requests):
            if time.monotonic() >= deadline:
                peers = sorted({peer for peer, _ in (*sends, *recvs)})
                self._broken = (
                    f"MPI sendrecv on rank {self.rank} of {self.size}: the transfers with "
                    f"rank(s) {peers} did not finish within {self.timeout:g} s (a rank died "
                    "or hangs); this communicator is no longer usable"
                )
                if self.abort_at_exit:
                    _abort_at_exit()
                raise CommTimeoutError(self._broken)
            time.sleep(delay)
            delay = min(delay * 2, _P2P_POLL_MAX)

    def barrier(self) -> None:
        """Collective: return once every rank has called it."""
        self._arrive("barrier")

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Collective: return ``root``'s ``obj`` on every rank (others' ``obj`` is ignored)."""
        self._check_root(root)
        self._arrive("broadcast")
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collective: every rank's ``obj`` in rank order on ``root``; None on the others."""
        self._check_root(root)
        self._arrive("gather")
        return self.comm.gather(obj, root=root)

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        """Collective: ``objs[r]`` (``objs`` given on ``root``) on each rank ``r``."""
        self._check_root(root)
        self._arrive("scatter")
        return self.comm.scatter(objs, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj``, in rank order, on every rank."""
        self._arrive("allgather")
        return self.comm.allgather(obj)

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Collective: every rank's ``data`` (any length, empty too) on ``root``; else None."""
        self._check_root(root)
        self._arrive("gather_bytes")
        return self.comm.gather(bytes(data), root=root)

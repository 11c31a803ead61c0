"""The communicator protocol and the rule that one rank's failure fails every rank.

Every collective below must be called by every rank of the communicator, in the same
order (as with MPI). Only small Python objects travel through them: descriptions,
plans, statuses and the bytes of small tensors gathered to one writer. Tensor data of
ordinary size never goes through a communicator; each rank writes its own files.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from distckpt import settings
from distckpt.comm.outcome import share

#: Default bound, in seconds, on how long a collective waits for a missing rank.
DEFAULT_TIMEOUT = settings.TIMEOUT.built_in

#: The rank that coordinates a save: it validates the ranks' descriptions, plans, writes
#: the index and commits.
COORDINATOR = 0

#: Environment variable that overrides :data:`DEFAULT_TIMEOUT` (seconds, a float).
TIMEOUT_ENV = settings.TIMEOUT.name


def resolve_timeout(timeout: float | None) -> float:
    """Return ``timeout`` if given, else ``$DISTCKPT_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    Purely local (no communication). Raises ValueError for a non-positive or unparsable value.
    """
    if timeout is None:
        return settings.TIMEOUT.value()
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"a communicator timeout must be positive seconds, got {timeout}")
    return timeout


@runtime_checkable
class Communicator(Protocol):
    """What distckpt needs from a process group.

    ``rank`` and ``size`` are this process's place in the group. ``timeout`` bounds every
    collective (seconds): a rank that died or stopped participating makes the others raise
    :class:`~distckpt.errors.CommTimeoutError` instead of hanging.

    Optional, used where present (the bundled communicators have them): ``scatter(objs,
    root)`` (each rank receives only its object of a new save plan; without it the list
    is broadcast), ``split(color)`` (the communicator of the ranks passing the same color,
    None for a negative one) and ``broadcast_array(array, root)`` (in place), with which
    ranks restoring the same boxes share their reads (:mod:`distckpt.transfer.exchange`),
    and ``sendrecv(sends, recvs)`` (point-to-point byte arrays, all at once), with which
    the node-local tier copies partitions to peers and back (:mod:`distckpt.local`).
    """

    #: This process's place in the group, from 0 to ``size - 1``.
    rank: int
    #: The number of processes in the group.
    size: int
    #: Seconds every collective waits for the other ranks.
    timeout: float

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj`` as given on ``root``, on every rank."""

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return every rank's ``obj`` (in rank order) on ``root``; None elsewhere."""

    def allgather(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj``, in rank order, on every rank."""

    def gather_bytes(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Like :meth:`gather`, for one byte buffer per rank (small tensors to one writer)."""


def scatter(comm: Communicator, objs: list[Any] | None, root: int = 0) -> Any:
    """Collective: ``objs[r]`` (given on ``root``, one per rank) on each rank ``r``.

    Uses ``comm.scatter`` where the communicator has one (every rank receives only its
    own object); a communicator without it broadcasts the whole list."""
    own = getattr(comm, "scatter", None)
    if own is not None:
        return own(objs, root=root)
    everything = comm.broadcast(objs, root=root)
    return everything[comm.rank]


def background(comm: Communicator) -> Communicator:
    """Collective at first use: a communicator over ``comm``'s ranks whose collectives
    never mix with ``comm``'s, for a background thread (``comm.background()``: an
    ``MPI_Comm_dup``, a new gloo group; cached). A communicator without ``background``
    cannot save in the background."""
    make = getattr(comm, "background", None)
    if make is None:
        raise TypeError(
            f"{type(comm).__name__} has no background() method, which a background "
            "(async) save needs; save with async_save=False"
        )
    dup: Communicator = make()
    return dup


def raise_if_any_failed(comm: Communicator, exc: BaseException | None) -> None:
    """Collective: if any rank passes an exception, raise it on every rank.

    The lowest failing rank's exception is raised everywhere, as the same type with the
    same message, with ``exc.rank`` set to that rank and a note carrying its traceback.
    The rank where it happened re-raises its own exception object. Ranks that passed
    ``None`` raise only when another rank failed, so every rank leaves the same way.
    """
    share(comm, None, exc)

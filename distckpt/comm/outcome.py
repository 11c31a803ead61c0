"""Carrying one rank's failure to every rank: the collective steps every protocol is made of.

* :func:`coordinate`: every rank sends its contribution (or the :class:`Failure` that
  replaced it) to the coordinator, which decides; every rank gets the decision, or the
  same error. The plan and the commit of a save, the plan and the finish of a Hugging
  Face export are such steps.
* :func:`announce`: the coordinator alone computes something (reads an index, decides
  whether to save); every rank gets it, or the same error.
* :func:`share`: every rank gets every rank's payload, or the same error (no
  coordinator: each rank acts on what all sent).

In each, every rank either continues or raises the same exception (as the original
object on the rank where it happened, as a copy carrying that rank's traceback
elsewhere), so no rank is left waiting in a collective the others have abandoned. Each
takes the communicator's collectives and so its deadline (``DISTCKPT_TIMEOUT``): a dead
rank makes the others raise :class:`~distckpt.errors.CommTimeoutError`.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from distckpt.errors import RemoteError


@dataclass
class Failure:
    """An exception captured on ``rank``, ready to travel between ranks."""

    rank: int
    error: BaseException
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException, rank: int) -> Failure:
        tb = "".join(traceback.format_exception(exc))
        try:
            portable: BaseException = pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - anything unpicklable travels as its text
            portable = RemoteError(f"{type(exc).__name__}: {exc}")
        return cls(rank, portable, tb)

    def raise_here(self, my_rank: int, local: BaseException | None = None) -> None:
        """Raise this failure on ``my_rank``: the original object where it happened."""
        if local is not None and my_rank == self.rank:
            _set_rank(local, self.rank)
            raise local
        error = self.error
        _add_note(error, f"[distckpt] raised on rank {self.rank}; its traceback:\n{self.traceback}")
        _set_rank(error, self.rank)
        raise error from None


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which stores but does not print notes)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
        notes.append(note)
        with contextlib.suppress(AttributeError):
            exc.__notes__ = notes  # type: ignore[attr-defined]


def _set_rank(exc: BaseException, rank: int) -> None:
    with contextlib.suppress(AttributeError):
        exc.rank = rank  # type: ignore[attr-defined]


def first_failure(payloads: list[Any] | None) -> Failure | None:
    """The failure of the lowest rank among gathered payloads, if any."""
    for payload in payloads or ():
        if isinstance(payload, Failure):
            return payload
    return None


T = TypeVar("T")


def coordinate(
    comm: Any,
    contribution: Any,
    decide: Callable[[list[Any]], T],
    *,
    error: BaseException | None = None,
    settle: Callable[[Failure | None], None] | None = None,
    root: int = 0,
) -> T:
    """Collective: the coordinator decides from every rank's contribution; every rank
    returns the decision or raises the same error.

    Call order, on every rank: ``comm.gather(contribution, root)``; on ``root`` only, when
    no rank sent a :class:`Failure`, ``decide(contributions)`` (in rank order; an exception
    it raises becomes the outcome), then ``settle(failure or None)`` (cleanup that must
    happen before any rank goes on, such as removing what a failed save wrote);
    ``comm.broadcast(outcome, root)``; then every rank returns the decision or raises the
    lowest failing rank's error. ``error`` is this rank's own exception when its
    ``contribution`` is the :class:`Failure` of it: that rank raises the object itself.
    A decision is never a :class:`Failure` itself.
    """
    gathered = collect(comm, contribution, root=root)
    outcome: Any = gathered
    if isinstance(gathered, list):
        try:
            outcome = decide(gathered)
        except Exception as exc:
            error, outcome = exc, Failure.capture(exc, comm.rank)
    if comm.rank == root and settle is not None:
        try:
            settle(outcome if isinstance(outcome, Failure) else None)
        except Exception as exc:
            if not isinstance(outcome, Failure):
                error, outcome = exc, Failure.capture(exc, comm.rank)
    return deliver(comm, outcome, error, root)


def collect(comm: Any, contribution: Any, *, root: int = 0) -> list[Any] | Failure | None:
    """Collective, the first half of :func:`coordinate` written out as steps:
    ``comm.gather(contribution, root)``; on ``root``, every rank's contribution in rank
    order, or the lowest failing rank's :class:`Failure`; None on the other ranks. The
    coordinator decides from the list (its exception captured as the outcome), then every
    rank calls :func:`deliver`."""
    gathered = comm.gather(contribution, root=root)
    if comm.rank != root:
        return None
    assert gathered is not None
    return first_failure(gathered) or list(gathered)


def announce(comm: Any, compute: Callable[..., T], *args: Any, root: int = 0) -> T:
    """Collective: ``compute(*args)`` on ``root`` alone; every rank returns its result or
    raises its error (call order: ``compute`` on ``root``, then ``comm.broadcast``)."""
    outcome: Any = None
    error: BaseException | None = None
    if comm.rank == root:
        try:
            outcome = compute(*args)
        except Exception as exc:
            error, outcome = exc, Failure.capture(exc, comm.rank)
    return deliver(comm, outcome, error, root)


def share(comm: Any, payload: Any, error: BaseException | None = None) -> list[Any]:
    """Collective: every rank's ``payload`` in rank order (``comm.allgather``), or, when any
    rank passes its ``error`` (or a :class:`Failure` captured earlier as its payload), that
    error raised on every rank (the lowest rank's)."""
    sent = Failure.capture(error, comm.rank) if error is not None else payload
    everyone = comm.allgather(sent)
    failure = first_failure(everyone)
    if failure is not None:
        failure.raise_here(comm.rank, error)
    return list(everyone)


def deliver(comm: Any, outcome: Any, error: BaseException | None, root: int = 0) -> Any:
    """Collective, the second half of :func:`coordinate`: ``root``'s ``outcome`` (a
    decision, or a :class:`Failure`) broadcast; every rank returns the decision or raises
    the failure (as ``error`` itself on the rank it came from)."""
    outcome = comm.broadcast(outcome, root=root)
    if isinstance(outcome, Failure):
        outcome.raise_here(comm.rank, error)
    return outcome

"""The communicator protocol and the rule that one rank's failure fails every rank.

Every collective below must be called by every rank of the communicator, in the same
order (as with MPI). Only small Python objects travel through them: descriptions,
plans, statuses and the bytes of small tensors gathered to one writer. Tensor data of
ordinary size never goes through a communicator; each rank writes its own files.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from distckpt.errors import RemoteError

#: Default bound, in seconds, on how long a collective waits for a missing rank.
DEFAULT_TIMEOUT = 300.0

#: Environment variable that overrides :data:`DEFAULT_TIMEOUT` (seconds, a float).
TIMEOUT_ENV = "DISTCKPT_TIMEOUT"


def resolve_timeout(timeout: float | None) -> float:
    """Return ``timeout`` if given, else ``$DISTCKPT_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    Purely local (no communication). Raises ValueError for a non-positive or unparsable value.
    """
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
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
    """

    rank: int
    size: int
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


def _portable(exc: BaseException) -> BaseException:
    """Return ``exc`` if it survives pickling, else a RemoteError that says what it was."""
    try:
        clone = pickle.loads(pickle.dumps(exc))
        if isinstance(clone, BaseException):
            return exc
    except Exception:  # noqa: BLE001 - any failure to pickle means "not portable"
        pass
    return RemoteError(f"{type(exc).__name__}: {exc}")


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


def raise_if_any_failed(comm: Communicator, exc: BaseException | None) -> None:
    """Collective: if any rank passes an exception, raise it on every rank.

    The lowest failing rank's exception is raised everywhere, as the same type with the
    same message, with ``exc.rank`` set to that rank and a note carrying its traceback.
    The rank where it happened re-raises its own exception object. Ranks that passed
    ``None`` raise only when another rank failed, so every rank leaves the same way.
    """
    payload: tuple[BaseException, str] | None = None
    if exc is not None:
        tb = "".join(traceback.format_exception(exc))
        payload = (_portable(exc), tb)
    statuses: Sequence[tuple[BaseException, str] | None] = comm.allgather(payload)
    for failed_rank, status in enumerate(statuses):
        if status is None:
            continue
        if failed_rank == comm.rank and exc is not None:
            error = exc
        else:
            error = status[0]
            note = f"[distckpt] raised on rank {failed_rank}; its traceback:\n{status[1]}"
            _add_note(error, note)
        with contextlib.suppress(AttributeError):
            error.rank = failed_rank  # type: ignore[attr-defined]
        if error is exc:
            raise error
        raise error from None
    return None

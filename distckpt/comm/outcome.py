"""Carrying one rank's failure to every rank, for phases that gather to and decide on a root.

A phase of the save protocol ends with a gather to the coordinator (each rank sends its
result or a :class:`Failure`) and a broadcast of the coordinator's decision (the next
step's input or the first failure). Every rank then either continues or raises the same
exception, so no rank is left waiting in a collective the others have abandoned.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from dataclasses import dataclass
from typing import Any

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

"""What every run of a pipeline starts with, and what its stages are given: the clock
and the progress display."""

from __future__ import annotations

import time

from distckpt.comm import Communicator, auto
from distckpt.pipeline import background
from distckpt.progress import Progress, progress


def communicator(comm: Communicator | None) -> Communicator:
    """The first call of every save and restore, on every rank: wait for the pending
    background save (raising its error if nobody saw it), then ``comm`` (default:
    :func:`~distckpt.comm.auto`)."""
    background.finish_pending()
    return comm or auto()


class Clock:
    """The clock of one save (each stage's seconds: :meth:`lap`) and its progress
    display (:meth:`progress`: rank 0's, on a terminal, never in the background)."""

    def __init__(self, rank: int, *, show_progress: bool = True) -> None:
        self.rank = rank
        self.show_progress = show_progress
        self.t0 = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Record the seconds since the previous lap (or the start) as ``name``."""
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now

    def timings(self) -> dict[str, float]:
        """Every lap in order, and their ``total``."""
        return {**self.laps, "total": self._last - self.t0}

    def progress(self, label: str, total: int) -> Progress:
        """The display of ``total`` bytes (``with clock.progress(...) as bar``, then
        ``bar.update(n)``): shown where :func:`distckpt.progress.progress` says."""
        return progress(label, total if self.show_progress else 0, rank=self.rank)

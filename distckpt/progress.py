"""One-line progress display for long saves, loads, verifies and exports.

Shown only where someone watches: on rank 0, when the stream (stderr by default) is a
terminal, for operations of at least ``threshold`` bytes (256 MiB by default; the
command line shows every verify and export), and never when ``DISTCKPT_PROGRESS=0``.
The line is redrawn in place (carriage return) at most ten times a second and ended with
a newline when the operation ends, failed or not::

    with progress("verifying run/ckpt-10", total_bytes) as bar:
        verify("run/ckpt-10", on_bytes=bar.update)

    verifying run/ckpt-10: 1.2 GiB of 4.0 GiB (30%), 850.3 MiB/s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from distckpt import settings
from distckpt.terminal import printable

ENV = settings.PROGRESS.name
THRESHOLD = 256 * 1024 * 1024
INTERVAL = 0.1  # seconds between redraws


def human(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Bytes done of ``total``, redrawn on ``stream``; does nothing unless ``enabled``."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = printable(label)  # a path from the user or from storage
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._stream = stream
        self._clock = clock
        self._start = clock()
        self._last_draw: float | None = None
        self._width = 0

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more done (the ``on_bytes`` hooks take this method)."""
        self.done += nbytes
        if not self.enabled:
            return
        now = self._clock()
        if self._last_draw is None or now - self._last_draw >= INTERVAL:
            self._draw(now)

    def close(self) -> None:
        """Draw the final state and end the line (once)."""
        if not self.enabled:
            return
        self._draw(self._clock())
        self._stream.write("\n")
        self._stream.flush()
        self.enabled = False

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        percent = f" ({100 * self.done // self.total}%)" if self.total > 0 else ""
        text = (
            f"{self.label}: {human(self.done)} of {human(self.total)}{percent}, "
            f"{human(self.done / elapsed)}/s"
        )
        self._stream.write("\r" + text.ljust(self._width))
        self._stream.flush()
        self._width = len(text)
        self._last_draw = now

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def progress(
    label: str,
    total: int,
    *,
    rank: int = 0,
    stream: TextIO | None = None,
    threshold: int | None = None,
) -> Progress:
    """A :class:`Progress`, enabled only on rank 0, on a terminal (``stream``, default
    stderr), for ``total`` of at least ``threshold`` bytes (default :data:`THRESHOLD`),
    and unless ``DISTCKPT_PROGRESS=0``."""
    out = sys.stderr if stream is None else stream
    enabled = (
        rank == 0
        and total > 0
        and total >= (THRESHOLD if threshold is None else threshold)
        and settings.PROGRESS.value()
        and _is_tty(out)
    )
    return Progress(label, total, out, enabled=enabled)


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or detached stream
        return False

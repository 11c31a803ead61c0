"""Background saves that yield to training: the priority of the threads that write them.

A background save writes while training goes on, on the same cores. Its threads (the
save's own thread once the snapshot is taken, and its I/O workers) therefore run

* at a lower CPU priority: ``nice`` more than the process's main thread
  (``setpriority`` on the thread, Linux's per-thread niceness). A thread of niceness 10
  weighs about a tenth of one of niceness 0, so a training step that needs the core gets
  it, and the save uses what training leaves idle;
* at the lowest best-effort I/O priority (``ioprio_set``, level 7) when ``nice`` is not 0:
  schedulers that know priorities (BFQ, mq-deadline) serve training's reads first;
* on the cores named by ``cpus``, when given (``sched_setaffinity`` on the thread): cores
  that training leaves free, such as those a data loader does not use.

Lowering a thread's priority cannot be undone without privileges, so the I/O workers of
background saves are a pool of their own (:mod:`distckpt.transfer.workers`), never used
by a blocking save or a load. A lazy save copies its tensors on its background thread
before it yields: training waits for those copies.

Where the system refuses (another OS, a container without the system calls), the save
runs at the training thread's priority and says so once in the log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("distckpt")

#: The niceness a background save adds by default.
DEFAULT_NICE = 10
_MAX_NICE = 19
#: ``ioprio_set`` (Linux, x86-64 and aarch64 system call numbers), best-effort class.
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT = 1, 2, 13
_LOWEST_BE_LEVEL = 7

_warned = False
_local = threading.local()


@dataclass(frozen=True)
class Yielding:
    """How a background save's threads yield: ``nice`` added to their niceness (0 to
    19), and the cores they may run on (None: the process's)."""

    nice: int = DEFAULT_NICE
    cpus: frozenset[int] | None = None

    @staticmethod
    def of(nice: object, cpus: Iterable[int] | None) -> Yielding:
        """Checked: ``nice`` a whole number from 0 to 19; ``cpus`` cores this process may
        use (a ValueError naming those it may not)."""
        if type(nice) is not int or not 0 <= nice <= _MAX_NICE:
            raise ValueError(f"background_nice must be a whole number from 0 to 19, got {nice!r}")
        if cpus is None:
            return Yielding(nice)
        chosen = frozenset(cpus)
        if not chosen or any(type(c) is not int or c < 0 for c in chosen):
            raise ValueError(f"background_cpus must name cores (whole numbers), got {cpus!r}")
        allowed = _allowed()
        if allowed is not None and not chosen <= allowed:
            raise ValueError(
                f"background_cpus names cores this process may not use: "
                f"{sorted(chosen - allowed)} (it may use {sorted(allowed)})"
            )
        return Yielding(nice, chosen)

    @property
    def active(self) -> bool:
        return bool(self.nice) or self.cpus is not None

    def apply(self) -> None:
        """Lower the calling thread's priority (and pin it) as this says; for good."""
        if not self.active:
            return
        tid = threading.get_native_id()
        try:
            if self.nice:
                # Relative to the process (its main thread), whichever thread made this
                # one: a thread inherits its maker's niceness, which may be lowered already.
                target = min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + self.nice)
                if os.getpriority(os.PRIO_PROCESS, tid) < target:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                _lowest_io_priority(tid)
            if self.cpus is not None:
                os.sched_setaffinity(0, self.cpus)  # 0: this thread
        except (AttributeError, OSError) as exc:
            _refused(exc)


def current() -> Yielding | None:
    """The yielding of the background save running on this thread, if any."""
    return getattr(_local, "yielding", None)


@contextmanager
def yielding(how: Yielding | None) -> Iterator[None]:
    """Lower this thread's priority as ``how`` says, and make it the priority of the I/O
    workers that tasks started here run on. Only for a thread of its own (a background
    save's): its priority stays lowered."""
    if how is None or not how.active:
        yield
        return
    how.apply()
    _local.yielding = how
    try:
        yield
    finally:
        _local.yielding = None


def _allowed(tid: int = 0) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except (AttributeError, OSError):
        return None


def _lowest_io_priority(tid: int) -> None:
    number = _SYS_IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    value = _IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT | _LOWEST_BE_LEVEL
    if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"ioprio_set: {os.strerror(errno)}")


def _refused(exc: BaseException) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("background saves run at the training thread's priority: %s", exc)

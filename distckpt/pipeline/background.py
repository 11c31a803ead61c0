"""Background saves: at most one per process, the next call waits for it.

``distckpt.save(..., async_save=True)`` snapshots the state on the calling thread, then
runs the rest of the save protocol (plan, write, commit) on a background thread, over the
communicator's :meth:`background` twin (a duplicated MPI communicator, a separate gloo
group), so the training thread's own collectives never meet distckpt's. The call returns
an :class:`AsyncSave`.

Rules, on every rank alike:

* one background save at a time: every save, load or restore first waits for the one
  running (:func:`finish_pending`), so at most one snapshot is alive and its buffers are
  reused by the next;
* an error in the background is never swallowed: :meth:`AsyncSave.wait` raises it, and if
  nobody waited, the next save, load or restore raises it (once) before doing anything;
* the commit happens only after every rank reported its data durable (the same protocol
  as a blocking save), and a pointer moves only after the commit.

The thread is not a daemon: a process that ends normally first finishes its save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from distckpt.comm import Communicator
from distckpt.comm.base import background as background_comm
from distckpt.comm.outcome import Failure
from distckpt.items import Leaf, flatten, gather_leaves
from distckpt.pipeline import snapshot
from distckpt.pipeline.results import SaveResult
from distckpt.pipeline.snapshot import BufferPool
from distckpt.transfer import priority
from distckpt.transfer.priority import Yielding

log = logging.getLogger("distckpt")

_lock = threading.Lock()
_pending: AsyncSave | None = None


class AsyncSave:
    """A save running in the background; returned by ``save(..., async_save=True)``.

    ``wait()`` blocks until the checkpoint is committed and returns the
    :class:`~distckpt.engine.save.SaveResult`, or raises the save's error (on every rank
    alike). ``done()`` tells without blocking. In lazy mode, ``wait_snapshot()`` returns
    once the lazily copied tensors are copied and may change again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._snapshot = threading.Event()
        self._finished = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._thread: threading.Thread | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] = []
        self._settled = False
        self._go = threading.Event()  # set by start() once the thread has started

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"AsyncSave({self.path!r}, {state})"

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until every tensor is copied (they may change again after this)."""
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"the snapshot of {self.path} is not complete after {timeout} s")

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the save finished; return its result or raise its error."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of {self.path} is still running after {timeout} s")
        self._settle()
        if self._error is not None:
            self._observed = True
            raise self._error
        assert self._result is not None
        return self._result

    @property
    def result(self) -> SaveResult:
        """The result of a finished save (blocks until then; raises its error)."""
        return self.wait()

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error or None)`` on the waiting thread once the save is settled.

        Callbacks run on whichever thread first waits for the finished save (``wait``,
        or the next save, load or restore), never on the background thread.
        """
        self._callbacks.append(fn)

    def _settle(self) -> None:
        if self._settled:
            return
        self._settled = True
        for fn in self._callbacks:
            fn(self._error)

    def _run(self, body: Callable[[AsyncSave], SaveResult]) -> None:
        # Let start() return to the caller first: a new thread that ran the save at once
        # would hold the GIL while ``Thread.start()`` waits for it, keeping the caller in
        # save() for up to a switch interval (5 ms) or more.
        self._go.wait()
        try:
            self._result = body(self)
        except BaseException as exc:  # delivered by wait() or the next call
            self._error = exc
            log.debug("background save of %s failed: %r", self.path, exc)
        finally:
            self._snapshot.set()
            self._finished.set()


def start(path: str, body: Callable[[AsyncSave], SaveResult]) -> AsyncSave:
    """Run ``body(handle)`` on a background thread and make it the pending save.

    The caller has called :func:`finish_pending` first. ``body`` calls
    ``handle._snapshot.set()`` once the lazy copies are made.
    """
    global _pending
    handle = AsyncSave(path)
    thread = threading.Thread(
        target=handle._run, args=(body,), name=f"distckpt-save {path}", daemon=False
    )
    handle._thread = thread
    try:
        thread.start()
    finally:
        handle._go.set()
    with _lock:  # only a save that runs can be waited for
        _pending = handle
    return handle


def pending() -> AsyncSave | None:
    """The background save started last, if it has not been waited for."""
    return _pending


def finish_pending() -> None:
    """Wait for the running background save, if any; raise its error if nobody saw it.

    Every save, load and restore calls this first, on every rank.
    """
    global _pending
    with _lock:
        handle, _pending = _pending, None
    if handle is None:
        return
    if not handle.done():
        t0 = time.perf_counter()
        handle._finished.wait()
        waited = time.perf_counter() - t0
        log.debug("waited %.3fs for the background save of %s", waited, handle.path)
    handle._settle()
    if handle._error is not None and not handle._observed:
        handle._observed = True
        raise handle._error


def snapshot_barrier() -> None:
    """Block until the pending save (if any) has copied every tensor it reads lazily."""
    handle = _pending
    if handle is not None:
        handle._snapshot.wait()


_POOL = BufferPool()


#: A rank's state as a background save sees it: its leaves, the host copy of each
#: tensor (by name) and its encoded values.
Snapped = tuple[list[Leaf], dict[str, np.ndarray], dict[str, Any]]


def save_in_background(
    state: dict[str, Any],
    comm: Communicator,
    allow_pickle: bool,
    lazy: bool | Callable[[str], bool],
    where: str,
    protocol: Callable[[Communicator, Snapped | Failure, BaseException | None], SaveResult],
    check: Callable[[], None] = lambda: None,
    yielding: Yielding | None = None,
) -> AsyncSave:
    """Snapshot ``state`` into the reusable host buffers on this thread (the ``lazy``
    tensors later, on the background thread), then run ``protocol(background comm,
    snapped, error)`` on a background thread: the save protocol of the shared store, or
    of the node-local tier (:mod:`distckpt.local.save`). ``check()`` runs first. A failure
    of either, or of the snapshot, reaches ``protocol`` as a :class:`Failure` (and
    ``error``, this rank's own exception), which reports it on every rank. Once the
    snapshot is complete the background thread and its I/O workers yield to training as
    ``yielding`` says (:mod:`distckpt.transfer.priority`)."""
    t0 = time.perf_counter()
    bg_comm = background_comm(comm)  # collective the first time
    everything = bool(lazy)
    is_lazy: Callable[[str], bool] = lazy if callable(lazy) else (lambda name: everything)
    error: BaseException | None = None
    snap: snapshot.Snapshot | Failure
    values: dict[str, Any] = {}
    try:
        check()
        leaves, values = gather_leaves(state, allow_pickle)
        snap = snapshot.take(leaves, _POOL, is_lazy)
    except Exception as exc:
        snap, error = Failure.capture(exc, comm.rank), exc
    blocked = time.perf_counter() - t0
    rank = comm.rank

    def body(handle: AsyncSave) -> SaveResult:
        snapped: Snapped | Failure
        if isinstance(snap, Failure):
            snapped = snap
        else:
            try:
                snapshot.finish(snap)
                snapped = (snap.leaves, snap.arrays, values)
            except Exception as exc:
                snapped = Failure.capture(exc, rank)
        handle._snapshot.set()
        with priority.yielding(yielding):
            result = protocol(bg_comm, snapped, error)
        result.timings["snapshot"] = blocked
        return result

    handle = start(where, body)
    log.debug("background save of %s started; the caller was blocked %.4fs", where, blocked)
    return handle


def prepare_async(state: dict[str, Any]) -> int:
    """Allocate the host buffers that background saves of ``state`` copy into, now,
    rather than in the first ``save(..., async_save=True)`` (which then returns as fast as
    the later ones); returns their bytes. Local (no communication). Buffers are pinned for
    GPU tensors. Call it once the state exists whole (an optimizer's state appears at its
    first step); tensors added later get their buffers at the first save that has them::

        distckpt.prepare_async({"model": model.state_dict(), "optim": opt.state_dict()})
    """
    leaves = flatten(state, allow_pickle=True)  # only the tensors matter here
    return snapshot.prepare(leaves, _POOL)

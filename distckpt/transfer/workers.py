"""A rank's I/O workers: how many, and the threads that run their tasks.

Every save and load splits its bytes into tasks (a range of inner chunks of one shard, a
small file) and runs them on a pool of threads. Threads, not processes: checksums
(crc32c), the codecs (zstd, blosc), copies and file I/O all release the GIL, and threads
read the tensors' memory (and the pinned staging slabs) in place, where processes would
need every byte copied to them first.

The default count is the cores this rank may use: its CPU affinity, shared with the other
ranks of its node when they overlap, ``min(affinity, cpus // local_ranks)``, at least 1
and at most :data:`MAX_DEFAULT`. Local ranks come from the launcher's variables
(``LOCAL_WORLD_SIZE`` from torchrun, ``OMPI_COMM_WORLD_LOCAL_SIZE``, ``MPI_LOCALNRANKS``,
``SLURM_NTASKS_PER_NODE``) or else from the communicator (ranks that share this host
name). Where the tensors are on an accelerator it is at most :data:`DEVICE_WORKERS`;
against an object store or a network file system (NFS, Lustre, GPFS, ...) at least
:data:`NETWORK_WORKERS` (:func:`choose_io_workers`, which also says why).
``$DISTCKPT_IO_WORKERS`` overrides the default; the ``io_workers`` keyword of ``save``
and ``load`` overrides both.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from distckpt import settings
from distckpt.settings import whole_number
from distckpt.transfer import priority
from distckpt.transfer.priority import Yielding

log = logging.getLogger("distckpt")

ENV = settings.IO_WORKERS.name
#: The default never exceeds this many workers per rank.
MAX_DEFAULT = 32
LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
)

T = TypeVar("T")


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def local_ranks_from_env() -> int | None:
    """Ranks on this node as the launcher tells them, or None when it does not."""
    for name in LOCAL_SIZE_VARS:
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return None


def local_ranks(comm: Any = None) -> int:
    """Ranks of this job on this node: the launcher's variables, else (collective on
    ``comm``, once per communicator) the ranks sharing this host name, else 1."""
    found = local_ranks_from_env()
    if found is not None or comm is None or getattr(comm, "size", 1) == 1:
        return found or 1
    cached = getattr(comm, "_distckpt_local_ranks", None)
    if cached is None:
        hosts = comm.allgather(socket.gethostname())
        cached = max(1, hosts.count(socket.gethostname()))
        with contextlib.suppress(AttributeError):  # with __slots__: ask again next time
            comm._distckpt_local_ranks = cached
    return int(cached)


def default_io_workers(local: int | None = None) -> int:
    """The worker count a rank uses when nothing says otherwise (see the module doc)."""
    found = settings.IO_WORKERS.get()
    if found is not None:
        return found
    local = local if local is not None else (local_ranks_from_env() or 1)
    cpus = os.cpu_count() or 1
    return max(1, min(_affinity(), cpus // max(1, local), MAX_DEFAULT))


#: The fewest workers a rank uses by default against an object store or a network file
#: system, whatever its share of the cores: each request mostly waits on the network, not
#: on a core.
NETWORK_WORKERS = 8
#: The most workers a rank uses by default when its tensors are on an accelerator: their
#: bytes come through the device-to-host copies and the pinned staging slabs, which more
#: threads only contend for (on 16-core H200 hosts, 8 workers saved 1.8x faster than 16
#: and loaded 1.3x faster: ``benchmarks/README.md``).
DEVICE_WORKERS = 8
#: File system types (``/proc/self/mountinfo``) whose requests go over a network.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cifs",
        "smb3",
        "ceph",
        "9p",
        "wekafs",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.blobfuse2",
        "fuse.mount-s3",
        "panfs",
        "orangefs",
        "pvfs2",
    }
)


@dataclass(frozen=True)
class WorkerChoice:
    """A rank's I/O worker count and what chose it (shown in progress output and
    logs, and reported in :class:`~distckpt.SaveResult` and :class:`~distckpt.LoadResult`)."""

    count: int
    reason: str

    def __str__(self) -> str:
        return f"{self.count} I/O workers: {self.reason}"


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` (or its nearest existing parent), as
    ``/proc/self/mountinfo`` names it; None where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    here = os.path.realpath(here)
    best, found = -1, None
    for line in lines:  # "id parent major:minor root mount-point opts ... - type source ..."
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        mount = fields[4].replace("\\040", " ")
        kind_at = fields.index("-") + 1
        inside = here == mount or here.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best and kind_at < len(fields):
            best, found = len(mount), fields[kind_at]
    return found


def on_device(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` (torch tensors, or anything else: ignored) lives on an
    accelerator."""
    for t in tensors:
        device = getattr(t, "device", None)
        if device is not None and getattr(device, "type", "cpu") not in ("cpu", "meta"):
            return True
    return False


def choose_io_workers(
    io_workers: int | None,
    local: int | None = None,
    *,
    network: bool = False,
    device: bool = False,
    path: str | os.PathLike[str] | None = None,
) -> WorkerChoice:
    """This rank's I/O workers and why: ``io_workers`` if given, else
    ``$DISTCKPT_IO_WORKERS``, else the cores this rank may use (shared with the ``local``
    ranks of its node: see :func:`local_ranks`), at most :data:`DEVICE_WORKERS`
    for tensors on an accelerator (``device``) and at least :data:`NETWORK_WORKERS`
    against an object store (``network``) or a network file system holding ``path``."""
    if io_workers is not None:
        return WorkerChoice(whole_number(io_workers, "io_workers"), "io_workers=")
    if settings.IO_WORKERS.is_set():
        return WorkerChoice(default_io_workers(), f"${ENV}")
    local = local or local_ranks_from_env() or 1
    count = default_io_workers(local)
    reason = f"{_affinity()} cores" + (f" shared by {local} ranks" if local > 1 else "")
    if device and count > DEVICE_WORKERS:
        count, reason = DEVICE_WORKERS, f"at most {DEVICE_WORKERS} for device tensors; {reason}"
    kind = None if network or path is None else filesystem_type(path)
    if kind in NETWORK_FILESYSTEMS:
        network, what = True, kind
    else:
        what = "an object store"
    if network and count < NETWORK_WORKERS:
        count, reason = NETWORK_WORKERS, f"at least {NETWORK_WORKERS} for {what}; {reason}"
    return WorkerChoice(count, reason)


def node_ranks_for(io_workers: int | None, comm: Any = None) -> int | None:
    """The ranks sharing this node (:func:`local_ranks`, which may ask ``comm``: call it
    on every rank) when the default count applies, else None (a count was given)."""
    if io_workers is not None or settings.IO_WORKERS.is_set():
        return None
    return local_ranks(comm)


def resolve_io_workers(io_workers: int | None, comm: Any = None, *, network: bool = False) -> int:
    """The count of :func:`choose_io_workers` for host tensors (which may ask ``comm``
    how many ranks share the node: call it on every rank)."""
    local = node_ranks_for(io_workers, comm)
    return choose_io_workers(io_workers, local, network=network).count


def interleaved(streams: Iterable[Sequence[T]], width: int) -> Iterator[T]:
    """The items of ``streams``, ``width`` streams at a time taken in turn: the first item
    of each stream of that window, then the second of each, and so on; then the next
    window. Fed to the workers in this order, each worker mostly keeps to one stream
    (one file): a file's writes take turns in the kernel anyway (its inode lock), and a
    file read by one worker at a time is read sequentially."""
    it = iter(streams)
    while window := list(itertools.islice(it, width)):
        for k in range(max(len(s) for s in window)):
            for stream in window:
                if k < len(stream):
                    yield stream[k]


#: A pool per worker count and priority (None: the training thread's; see
#: :mod:`distckpt.transfer.priority`): a lowered thread is never used at full priority.
PoolKey = tuple[int, Yielding | None]
_pools: dict[PoolKey, ThreadPoolExecutor] = {}
_users: dict[PoolKey, int] = {}  # task groups using each pool now
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: its parent's threads are not there; start afresh if needed."""
    global _pools_lock
    _pools.clear()
    _users.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _acquire(key: PoolKey) -> ThreadPoolExecutor:
    """The process's pool of ``key[0]`` I/O threads at priority ``key[1]``, kept for the
    next save or load; pools of other kinds that nobody uses are shut down."""
    with _pools_lock:
        for other in [k for k, users in _users.items() if not users and k != key]:
            _pools.pop(other).shutdown(wait=False)
            del _users[other]
        found = _pools.get(key)
        if found is None:
            workers, how = key
            found = _pools[key] = ThreadPoolExecutor(
                workers,
                thread_name_prefix="distckpt-io" if how is None else "distckpt-bg",
                initializer=None if how is None else how.apply,
            )
        _users[key] = _users.get(key, 0) + 1
        return found


def _release(key: PoolKey) -> None:
    with _pools_lock:
        if _users.get(key):
            _users[key] -= 1


class Usage:
    """How busy the I/O workers were, over every task group of this process so far:
    ``busy_s``, the seconds the tasks ran; ``capacity_s``, the workers' seconds (workers x
    the time from a group's first task to the end of its last). ``1 - busy_s /
    capacity_s`` is the share of the workers' time spent waiting while a group still had
    bytes to move (``benchmarks/bench_rank.py`` reports it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tasks = 0
        self.busy_s = 0.0
        self.capacity_s = 0.0

    def add(self, tasks: int, busy_s: float, capacity_s: float) -> None:
        with self._lock:
            self.tasks += tasks
            self.busy_s += busy_s
            self.capacity_s += capacity_s

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"tasks": self.tasks, "busy_s": self.busy_s, "capacity_s": self.capacity_s}


#: The process's :class:`Usage` of its I/O workers.
USAGE = Usage()


class TaskGroup:
    """Tasks of one save or load on the I/O pool; :meth:`wait` raises the first failure.

    After a task fails, tasks that have not started yet are skipped (``cancelled`` is
    set), so a failing save stops quickly; :meth:`wait` still waits for the ones running,
    so no task touches a file or a buffer once the group is done (even when the waiting
    thread is interrupted). ``on_bytes(n)`` (a progress hook) is called with each
    finished task's return value, one call at a time. A group holds its pool of threads
    until its last :meth:`wait`.

    ``inline`` runs each task on the submitting thread as it is submitted, with no pool:
    what one worker with nothing to overlap should do (a hand-off to another thread
    costs a wake-up per task and, on a VM, may move the writes to a core whose free
    pages the hypervisor has taken back, doubling their cost in the kernel).
    """

    def __init__(
        self,
        workers: int,
        on_bytes: Callable[[int], None] | None = None,
        *,
        inline: bool = False,
    ) -> None:
        self.workers = workers
        self.inline = inline
        # A background save's tasks run at its priority (set on its thread).
        self._key: PoolKey = (workers, priority.current())
        self._pool: ThreadPoolExecutor | None = None if inline else _acquire(self._key)
        self._held = not inline
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()
        self._on_bytes = on_bytes
        self.cancelled = threading.Event()
        self._first: float | None = None  # when the first task of this round was submitted
        self._busy = 0.0  # seconds the tasks of this round ran (summed under ``_lock``)

    def submit(
        self,
        fn: Callable[..., int | None],
        *args: Any,
        release: Callable[[], None] | None = None,
    ) -> Future[Any]:
        """Run ``fn(*args)`` on a worker; ``release()`` runs after it, or instead of it
        when the task is skipped, in every case (it frees what the task held)."""
        if self._first is None:
            self._first = time.perf_counter()
        if self.inline:
            future: Future[Any] = Future()
            try:
                future.set_result(self._run(fn, args, release))
            except Exception as exc:  # raised by wait(), as a worker's would be
                future.set_exception(exc)
            self._futures.append(future)
            return future
        if not self._held:  # waited for already: hold the pool again
            self._pool, self._held = _acquire(self._key), True
        assert self._pool is not None
        future = self._pool.submit(self._run, fn, args, release)
        self._futures.append(future)
        return future

    def _run(
        self,
        fn: Callable[..., int | None],
        args: tuple[Any, ...],
        release: Callable[[], None] | None,
    ) -> int | None:
        start = time.perf_counter()
        try:
            try:
                n = None if self.cancelled.is_set() else fn(*args)
            finally:
                if release is not None:
                    release()
            with self._lock:
                self._busy += time.perf_counter() - start
                if n and self._on_bytes is not None:
                    self._on_bytes(n)
        except BaseException:
            self.cancelled.set()
            raise
        return n

    def __enter__(self) -> TaskGroup:
        """``with group:`` around the code that submits the tasks: at the end of the block
        every task is waited for. If the block or a task fails, the tasks not started are
        skipped and, once every running one has stopped, the first error is raised (the
        block's first)."""
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is not None:
            self.cancelled.set()
        try:
            self.wait()
        except BaseException:
            if error is None:
                raise
            # the block's error is raised (by the with statement), the tasks' dropped

    def check(self) -> None:
        """Raise now if a task has already failed (waiting for the running ones first)."""
        if self.cancelled.is_set():
            self.wait()

    def wait(self) -> None:
        """Wait for every task; raise the first failure in submission order. Interrupted
        (KeyboardInterrupt) while waiting, it skips the tasks not started, still waits for
        the running ones, then raises the interruption."""
        interrupted: BaseException | None = None
        while True:
            try:
                futures.wait(self._futures)
                break
            except BaseException as exc:
                self.cancelled.set()
                interrupted = interrupted or exc
        done, self._futures = self._futures, []
        if self._first is not None:
            span = time.perf_counter() - self._first
            with self._lock:
                busy, self._busy, self._first = self._busy, 0.0, None
            USAGE.add(len(done), busy, span * (1 if self.inline else self.workers))
        if self._held:
            _release(self._key)
            self._held = False
        if interrupted is not None:
            raise interrupted
        for future in done:
            failure = future.exception()
            if failure is not None:
                raise failure


class Countdown:
    """Calls ``last()`` when ``done()`` has been called ``n`` times (from any thread)."""

    def __init__(self, n: int, last: Callable[[], None]) -> None:
        self._left = n
        self._last = last
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            final = self._left == 0
        if final:
            self._last()

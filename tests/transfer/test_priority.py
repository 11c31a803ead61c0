"""Background saves yield to training: their threads' niceness, I/O priority and cores
(:mod:`distckpt.transfer.priority`), read back from the kernel; one I/O worker writing on
the calling thread; small files made durable together (:meth:`PosixStore.sync`)."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt.storage import fsutil
from distckpt.storage.backend import syncing
from distckpt.storage.posix import PosixStore
from distckpt.transfer import workers
from distckpt.transfer.priority import Yielding
from distckpt.transfer.workers import TaskGroup
from tests.engine.test_single_process import load1, random_tensor, save1
from tests.support.make_golden import assert_same_bits

linux_only = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31}


def _ioprio(tid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(_SYS_IOPRIO_GET[os.uname().machine], 1, tid))


def _pool_threads(yielding: Yielding | None) -> list[threading.Thread]:
    found = [p for (_, how), p in workers._pools.items() if how == yielding]
    assert found, f"no I/O pool of priority {yielding}: {list(workers._pools)}"
    return list(found[0]._threads)


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": random_tensor(torch.float32, (512, 256), i) for i in range(4)}


@linux_only
@pytest.mark.skipif(os.uname().machine not in _SYS_IOPRIO_GET, reason="ioprio_get number")
def test_a_background_save_writes_at_a_lower_priority_on_its_cores(tmp_path: Path) -> None:
    state = _state()
    core = min(os.sched_getaffinity(0))
    base_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    handle = distckpt.save(
        state,
        tmp_path / "bg",
        async_save=True,
        io_workers=2,
        background_nice=5,
        background_cpus=[core],
        inner_bytes=64 << 10,  # several tasks: both workers start
    )
    handle.wait()
    how = Yielding(5, frozenset({core}))
    threads = _pool_threads(how)
    assert threads
    for thread in threads:
        tid = thread.native_id
        assert tid is not None
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base_nice + 5)
        assert os.sched_getaffinity(tid) == {core}
        assert _ioprio(tid) == (2 << 13) | 7  # best effort, level 7
    # the calling thread is as it was
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base_nice
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load1(target, tmp_path / "bg", io_workers=2)
    for k, v in state.items():
        assert_same_bits(target[k], v)
    # a blocking save never runs on the lowered threads
    save1(state, tmp_path / "fg", io_workers=2, inner_bytes=64 << 10)
    for thread in _pool_threads(None):
        assert thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == base_nice


def test_background_nice_zero_keeps_the_training_priority(tmp_path: Path) -> None:
    state = _state()
    distckpt.save(state, tmp_path / "c", async_save=True, io_workers=2, background_nice=0).wait()
    assert Yielding(0, None) not in [how for _, how in workers._pools]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load1(target, tmp_path / "c")
    for k, v in state.items():
        assert_same_bits(target[k], v)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"background_nice": 20}, "background_nice must be a whole number from 0 to 19, got 20"),
        ({"background_nice": -1}, "from 0 to 19, got -1"),
        ({"background_nice": 2.5}, "from 0 to 19, got 2.5"),
        ({"background_cpus": []}, "background_cpus must name cores"),
        ({"background_cpus": [-1]}, "background_cpus must name cores"),
        ({"background_cpus": [4096]}, r"cores this process may not use: \[4096\]"),
    ],
)
def test_bad_background_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        distckpt.CheckpointOptions(**fields)


def test_one_worker_runs_on_the_calling_thread_and_stops_at_the_first_failure() -> None:
    group = TaskGroup(1, inline=True)
    ran: list[tuple[int, int]] = []
    released: list[int] = []

    def task(i: int) -> int:
        ran.append((i, threading.get_ident()))
        if i == 1:
            raise RuntimeError("task 1 failed")
        return 1

    for i in range(4):
        group.submit(task, i, release=lambda i=i: released.append(i))
    with pytest.raises(RuntimeError, match="task 1 failed"):
        group.wait()
    assert ran == [(0, threading.get_ident()), (1, threading.get_ident())]
    assert released == [0, 1, 2, 3]  # the skipped tasks let go too


def test_an_interrupt_in_an_inline_task_is_raised_at_once() -> None:
    group = TaskGroup(1, inline=True)

    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        group.submit(interrupted)
    assert group.cancelled.is_set()


def test_a_save_with_one_worker_starts_no_thread(tmp_path: Path) -> None:
    state = _state()
    before = {t.ident for t in threading.enumerate()}
    save1(state, tmp_path / "one", io_workers=1, inner_bytes=64 << 10)
    assert {t.ident for t in threading.enumerate()} <= before
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load1(target, tmp_path / "one", io_workers=1)
    for k, v in state.items():
        assert_same_bits(target[k], v)


@linux_only
def test_small_files_are_made_durable_together_where_syncfs_serves(tmp_path: Path) -> None:
    store = PosixStore(tmp_path)
    kind = fsutil.syncfs_kind(os.open(tmp_path, os.O_RDONLY))
    assert (syncing(store) is not None) == (kind is not None)
    proc = PosixStore("/proc/self")
    assert syncing(proc) is None  # not a file system whose syncfs reports failures
    with pytest.raises(OSError, match="syncfs: Bad file descriptor"):
        fsutil.syncfs(-1)

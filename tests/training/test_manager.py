"""distckpt.CheckpointManager: retention, adoption, schedules, the directory lock and the
takeover by a newer manager in the same process.

Mostly one process (``SingleComm``), time faked with an injected clock. The lock between
processes and the retention of a 2-rank job run on every store (``backend``: a
directory, S3, Azure).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
from distckpt.comm import SingleComm
from distckpt.commit import claim as claim_mod
from distckpt.commit.staging import collect_garbage, leftovers
from distckpt.format import index as index_mod
from distckpt.storage.registry import open_store
from distckpt.training import Checkpoint, CheckpointManager, latest_checkpoint
from distckpt.training.lock import LOCK_FILE, DirectoryLockedError
from distckpt.training.pointer import read_pointer
from tests.support.backends import Backend
from tests.support.launch_util import (
    SCRIPTS,
    assert_all_ok,
    cases,
    check,
    finish,
    job_env,
    load_script,
    needs_mpi,
    output,
    run_mpi_ranks,
    run_ranks,
    start,
)

pytestmark = pytest.mark.timeout(120)
COMM = SingleComm()
S3_RANKS = SCRIPTS / "s3_ranks.py"  # its manager mode runs on any store
sr = load_script(S3_RANKS, "s3_ranks_script")


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _ckpt(value: float = 0.0) -> Checkpoint:
    return Checkpoint(step=torch.tensor(1), w=torch.full((3,), value))


def _names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def test_exported() -> None:
    assert distckpt.CheckpointManager is CheckpointManager
    assert issubclass(DirectoryLockedError, distckpt.CheckpointError)


def test_max_to_keep_across_restart(tmp_path: Path) -> None:
    ckpt = _ckpt()
    with CheckpointManager(ckpt, tmp_path, max_to_keep=3, comm=COMM) as manager:
        assert manager.latest_checkpoint is None and manager.checkpoints == []
        for _ in range(4):
            manager.save()
        assert _names(manager.checkpoints) == ["ckpt-2", "ckpt-3", "ckpt-4"]
    with CheckpointManager(_ckpt(), tmp_path, max_to_keep=3, comm=COMM) as again:
        assert _names(again.checkpoints) == ["ckpt-2", "ckpt-3", "ckpt-4"]
        assert again.latest_checkpoint == str(tmp_path / "ckpt-4")
        assert again.restore_or_initialize() == str(tmp_path / "ckpt-4")
        assert again.checkpoint.save_counter == 4
        path = again.save()
        assert path == str(tmp_path / "ckpt-5")
        assert _names(again.checkpoints) == ["ckpt-3", "ckpt-4", "ckpt-5"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == [
        "ckpt-3",
        "ckpt-4",
        "ckpt-5",
    ]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-5")
    doc = json.loads((tmp_path / "latest").read_text())
    assert doc["latest"] == "ckpt-5" and doc["all"] == ["ckpt-3", "ckpt-4", "ckpt-5"]
    assert leftovers(tmp_path) == []


def test_keep_every_n_hours(tmp_path: Path) -> None:
    clock = Clock()
    manager = CheckpointManager(
        _ckpt(),
        tmp_path,
        max_to_keep=2,
        keep_checkpoint_every_n_hours=1,
        comm=COMM,
        clock=clock,
    )
    for _ in range(8):  # one save every 20 minutes, starting at t0 + 20 min
        clock.now += 1200
        manager.save()
    # ckpt-1..6 fell out of the newest 2; one per hour (from construction) was kept:
    # ckpt-3 (t0+60 min) and ckpt-6 (t0+120 min).
    assert _names(manager.checkpoints) == ["ckpt-7", "ckpt-8"]
    assert _names(manager.preserved_checkpoints) == ["ckpt-3", "ckpt-6"]
    on_disk = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
    assert on_disk == ["ckpt-3", "ckpt-6", "ckpt-7", "ckpt-8"]
    manager.close()
    again = CheckpointManager(
        _ckpt(),
        tmp_path,
        max_to_keep=2,
        keep_checkpoint_every_n_hours=1,
        comm=COMM,
        clock=clock,
    )
    assert _names(again.preserved_checkpoints) == ["ckpt-3", "ckpt-6"]
    assert _names(again.checkpoints) == ["ckpt-7", "ckpt-8"]
    again.close()


def test_adopts_commit_without_pointer_update(tmp_path: Path) -> None:
    with CheckpointManager(_ckpt(), tmp_path, max_to_keep=3, comm=COMM) as manager:
        manager.save()
        manager.save()
    # A crash between the commit of ckpt-7 and the pointer update.
    _ckpt(7.0).write(tmp_path / "ckpt-7", COMM)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    ckpt = _ckpt()
    with CheckpointManager(ckpt, tmp_path, max_to_keep=3, comm=COMM) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-7"]
        assert manager.latest_checkpoint == str(tmp_path / "ckpt-7")
        assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-7")  # pointer fixed
        manager.restore_or_initialize()
        assert torch.equal(ckpt.w, torch.full((3,), 7.0))
        # save_counter restored as 0 -> 1 is taken, 2 is taken: next free number.
        path = manager.save()
        assert path == str(tmp_path / "ckpt-3")
        assert ckpt.save_counter == 3
        assert _names(manager.checkpoints) == ["ckpt-2", "ckpt-7", "ckpt-3"]
        # An explicit number that exists takes the next free one too.
        assert manager.save(checkpoint_number=7) == str(tmp_path / "ckpt-8")


def test_retention_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(_ckpt(), tmp_path, max_to_keep=1, comm=COMM)
    manager.save()

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        raise OSError("rmtree refused")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    manager.save()
    monkeypatch.undo()
    assert not (tmp_path / "ckpt-1").exists()
    trash = leftovers(tmp_path)
    assert len(trash) == 1 and trash[0].name.startswith(".ckpt-1.trash-")
    manager.close()
    # A new manager neither adopts nor restores it; collect_garbage removes it.
    with CheckpointManager(_ckpt(), tmp_path, max_to_keep=1, comm=COMM) as again:
        assert _names(again.checkpoints) == ["ckpt-2"]
    collect_garbage(tmp_path)
    assert leftovers(tmp_path) == []
    assert not (tmp_path / "ckpt-1").exists()


def test_checkpoint_interval(tmp_path: Path) -> None:
    ckpt = _ckpt()
    with CheckpointManager(
        ckpt,
        tmp_path,
        max_to_keep=None,
        checkpoint_interval=10,
        step_counter=ckpt.step,
        comm=COMM,
    ) as manager:
        saved = []
        for _ in range(30):
            if manager.save():
                saved.append(int(ckpt.step))
            ckpt.step.add_(1)
        assert saved == [1, 11, 21]
        assert manager.save(check_interval=False) is not None  # step 31, forced
        assert manager.save() is None
        assert len(manager.checkpoints) == 4


def test_save_interval_secs(tmp_path: Path) -> None:
    clock = Clock()
    with CheckpointManager(
        _ckpt(), tmp_path, save_interval_secs=600, comm=COMM, clock=clock
    ) as manager:
        assert manager.save() is not None  # at start
        clock.now += 599
        assert manager.save() is None
        clock.now += 1
        assert manager.save() is not None
        clock.now += 10
        assert manager.save() is None
        assert manager.save(check_interval=False) is not None  # at end
        assert _names(manager.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 5)


def _train(net: Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.tensor([[float(i)]])
        loss = (net.l1(x) - 5 * x).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_restore_or_initialize_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    ckpt = Checkpoint(step=torch.tensor(1), optimizer=opt, net=net)
    with CheckpointManager(ckpt, tmp_path, max_to_keep=3, comm=COMM) as manager:
        assert manager.restore_or_initialize() is None
        _train(net, opt, 3)
        ckpt.step.add_(3)
        path = manager.save()

    torch.manual_seed(1)
    net2 = Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.1)
    ckpt2 = Checkpoint(step=torch.tensor(1), optimizer=opt2, net=net2)
    with CheckpointManager(ckpt2, tmp_path, max_to_keep=3, comm=COMM) as manager:
        assert manager.restore_or_initialize() == path
    assert int(ckpt2.step) == 4
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(net.parameters(), net2.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt2.state[q][key]))
    _train(net, opt, 2)
    _train(net2, opt2, 2)
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_directory_none_uses_temp_dir(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="distckpt.training.manager"):
        manager = CheckpointManager(_ckpt(), None, comm=COMM)
    try:
        directory = Path(manager.directory)
        assert directory.name.startswith("distckpt-") and directory.is_dir()
        assert str(directory) in caplog.text
        assert manager.save() == str(directory / "ckpt-1")
    finally:
        manager.close()
        shutil.rmtree(manager.directory)


def test_new_manager_in_the_same_process_takes_over(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    first = CheckpointManager(_ckpt(1.0), tmp_path, comm=COMM)
    token = json.loads(lock.read_text())["token"]
    assert first.save() == str(tmp_path / "ckpt-1")
    ckpt = _ckpt()
    second = CheckpointManager(ckpt, tmp_path, comm=COMM)
    # The lock object passed over without a release: the file still holds the same token.
    assert second._own.lock is not None and second._own.lock.token == token
    assert json.loads(lock.read_text())["token"] == token
    assert _names(second.checkpoints) == ["ckpt-1"]
    assert second.restore_or_initialize() == str(tmp_path / "ckpt-1")
    assert torch.equal(ckpt.w, torch.full((3,), 1.0))
    assert second.save() == str(tmp_path / "ckpt-2")

    with pytest.raises(DirectoryLockedError, match="replaced by a newer"):
        first.save()
    assert first.restore_or_initialize() == str(tmp_path / "ckpt-1")  # reading is harmless
    first.close()
    assert json.loads(lock.read_text())["token"] == token
    del first
    gc.collect()
    assert json.loads(lock.read_text())["token"] == token
    assert second.save() == str(tmp_path / "ckpt-3")
    second.close()
    assert not lock.exists()

    # A closed manager is not taken over: the next one acquires the lock afresh.
    with CheckpointManager(_ckpt(), tmp_path, comm=COMM) as third:
        assert json.loads(lock.read_text())["token"] not in (token, None)
        assert _names(third.checkpoints) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert not lock.exists()


def test_takeover_waits_for_the_older_background_save(tmp_path: Path) -> None:
    first = CheckpointManager(_ckpt(2.0), tmp_path, comm=COMM)
    handle = first.save(async_save=True)
    second = CheckpointManager(_ckpt(), tmp_path, comm=COMM)
    try:
        assert handle.done()
        assert second.latest_checkpoint == handle.path == str(tmp_path / "ckpt-1")
        assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    finally:
        second.close()
        first.close()


def test_takeover_logs_the_older_background_save_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Failed:
        def wait(self) -> None:
            raise OSError("disk full")

    first = CheckpointManager(_ckpt(), tmp_path, comm=COMM)
    first._pending = Failed()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="distckpt.training.manager"):
        second = CheckpointManager(_ckpt(), tmp_path, comm=COMM)
    try:
        assert "disk full" in caplog.text and str(tmp_path) in caplog.text
        assert second.save() == str(tmp_path / "ckpt-1")
    finally:
        second.close()
        first.close()


_HOLDER = """
import sys
import torch
from distckpt.comm import SingleComm
from distckpt.training import Checkpoint, CheckpointManager

manager = CheckpointManager(Checkpoint(w=torch.zeros(3)), sys.argv[1], comm=SingleComm())
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
manager.close()
"""

_CONTENDER = """
import sys, torch, distckpt
from distckpt.training.lock import DirectoryLockedError
ckpt = distckpt.Checkpoint(x=torch.zeros(2))
try:
    comm = distckpt.comm.SingleComm()
    distckpt.CheckpointManager(ckpt, sys.argv[1], comm=comm).close()
except DirectoryLockedError as exc:
    print('LOCKED', exc)
else:
    print('ACQUIRED')
"""


def test_manager_of_another_process_is_refused(backend: Backend) -> None:
    """While a manager of another process holds a directory, a manager of it here is
    refused, and gets it once the other closed; the same the other way round (the other
    process is refused while this one holds it, and this one still saves). The lock is
    there while a manager lives and gone once it closed."""
    where = backend.url

    def locked() -> bool:
        return open_store(where).exists(LOCK_FILE)

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=job_env(backend.env),
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        readable, _, _ = select.select([holder.stdout], [], [], 60)
        assert readable, "the other process did not start its manager within 60 s"
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DirectoryLockedError, match="in use by another checkpoint manager"):
            CheckpointManager(_ckpt(), where, comm=COMM)
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(timeout=60)
    assert holder.returncode == 0
    assert not locked()
    with CheckpointManager(_ckpt(), where, comm=COMM):
        assert locked()
    assert not locked()

    mine = CheckpointManager(Checkpoint(x=torch.zeros(2)), where, comm=COMM)
    try:
        first = finish(start([sys.executable, "-c", _CONTENDER, where], backend.env), 60)
        mine.save()
    finally:
        mine.close()
    second = finish(start([sys.executable, "-c", _CONTENDER, where], backend.env), 60)
    check(first)
    check(second)
    assert first.stdout.startswith("LOCKED") and "in use by another" in first.stdout, output(first)
    assert second.stdout.startswith("ACQUIRED"), output(second)


def test_stale_lock_is_taken_over(tmp_path: Path) -> None:
    import socket

    # The owner process is gone on this host.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    lock = tmp_path / LOCK_FILE
    lock.write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": int(dead.stdout),
                "time": time.time(),
                "token": "x",
            }
        )
    )
    with CheckpointManager(_ckpt(), tmp_path, comm=COMM) as manager:
        assert manager.save() is not None
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    # A lease that expired, from another host.
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": 0, "token": "y"}))
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with CheckpointManager(_ckpt(), tmp_path, comm=COMM) as manager:
        assert _names(manager.checkpoints) == ["ckpt-1"]
    # A fresh lease from another host is respected.
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": 0, "token": "z"}))
    with pytest.raises(DirectoryLockedError):
        CheckpointManager(_ckpt(), tmp_path, comm=COMM)
    assert json.loads(lock.read_text())["token"] == "z"


_TWO_RANKS = """
import os, sys, time
import torch
import distckpt
from distckpt.training import Checkpoint, CheckpointManager

directory = sys.argv[1]
comm = distckpt.comm.auto()
clock = (lambda: 100.0) if comm.rank == 0 else (lambda: 1e9 + time.time())  # ranks disagree
ckpt = Checkpoint(step=torch.tensor(1), w=torch.arange(4.0))
with CheckpointManager(ckpt, directory, max_to_keep=2, save_interval_secs=60,
                       comm=comm, clock=clock) as manager:
    paths = [manager.save() for _ in range(3)]        # rank 0's clock: only the first saves
    assert paths[1:] == [None, None], paths
    for _ in range(3):
        manager.save(check_interval=False)
    assert [p.rsplit("/", 1)[1] for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
with CheckpointManager(Checkpoint(w=torch.zeros(4)), directory, comm=comm) as again:
    assert again.latest_checkpoint.endswith("ckpt-4"), again.latest_checkpoint
    assert again.restore_or_initialize() is not None
    assert torch.equal(again.checkpoint.w, torch.arange(4.0))
os.write(1, f"OK {comm.rank}\\n".encode())  # one write: the ranks share the pipe
"""


def test_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    proc = run_ranks(2, script, str(tmp_path / "run"), timeout=180)
    check(proc)
    assert "OK 0" in proc.stdout and "OK 1" in proc.stdout


@needs_mpi
def test_retention_across_ranks(backend: Backend) -> None:
    """A 2-rank job (tests/scripts/s3_ranks.py ``manager``): max_to_keep=2 over 4 saves
    (the last in the background), a directory locked by this process refused; then a new
    manager in this process restores the newest, and so does a plain Checkpoint.restore,
    consuming everything."""
    run, locked = f"{backend.url}/run", f"{backend.url}/locked"
    holder = CheckpointManager(Checkpoint(x=torch.zeros(2)), locked, comm=COMM)
    try:
        env = {**backend.env, "DISTCKPT_TIMEOUT": "30"}  # a dead rank fails, never hangs
        proc = run_mpi_ranks(2, S3_RANKS, "manager", run, locked, timeout=90, env=env)
    finally:
        holder.close()
    assert_all_ok(proc, 2)
    found = cases(proc)
    assert {r["type"] for r in found["manager-locked"].values()} == {"DirectoryLockedError"}

    left = backend.keys(run)
    assert not [k for k in left if k.startswith(("ckpt-1/", "ckpt-2/"))], left
    for name in ("ckpt-3", "ckpt-4"):
        assert f"{name}/zarr.json" in left and index_mod.is_committed(f"{run}/{name}")
    assert not [k for k in left if claim_mod.SUFFIX in k or LOCK_FILE in k], left
    assert backend.keys(locked) == []  # the holder's lock was released
    assert latest_checkpoint(run) == f"{run}/ckpt-4"
    assert read_pointer(run).all == ["ckpt-3", "ckpt-4"]  # type: ignore[union-attr]

    # This process is a new one: a new manager restores the newest...
    ckpt, net = sr.manager_checkpoint()
    with CheckpointManager(ckpt, run, max_to_keep=2, comm=COMM) as manager:
        assert manager.restore_or_initialize() == f"{run}/ckpt-4"
    step, w, params = sr.manager_values(4)
    assert torch.equal(ckpt.step, step) and torch.equal(ckpt.w, w)
    assert torch.equal(net.weight.detach(), params["weight"])
    assert torch.equal(net.bias.detach(), params["bias"])
    # ... and so does a plain Checkpoint.restore, consuming everything.
    other, other_net = sr.manager_checkpoint()
    other.restore(latest_checkpoint(run), COMM).assert_consumed()
    assert torch.equal(other.w, w) and torch.equal(other_net.bias.detach(), params["bias"])
    older, _ = sr.manager_checkpoint()
    older.restore(f"{run}/ckpt-3", COMM).assert_consumed()
    assert torch.equal(older.w, sr.manager_values(3)[1])


def test_delete_in_background_withdraws_at_once_and_removes_off_the_save_path(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delete_in_background=True``: the save returns while the removal of the checkpoint
    it retired is still held back, that checkpoint already out of sight (never listed,
    adopted or restored); the removal ends by ``sync`` (which a newer manager of the
    directory also calls before taking it over); a second save in the background waits
    for both. On every store."""
    from distckpt.training import retention

    entered, gate = threading.Event(), threading.Event()
    real = retention.Retention.withdraw

    def held_back(self: retention.Retention, name: str) -> Callable[[], None]:
        rest = real(self, name)

        def later() -> None:
            entered.set()
            assert gate.wait(60), "the test never let the removal go on"
            rest()

        return later

    monkeypatch.setattr(retention.Retention, "withdraw", held_back)
    run = f"{backend.url}/run"
    ckpt = _ckpt(1.0)
    manager = CheckpointManager(ckpt, run, max_to_keep=1, comm=COMM, delete_in_background=True)
    try:
        manager.save()
        ckpt.w.fill_(2.0)
        assert manager.save() == f"{run}/ckpt-2"
        assert entered.wait(30)  # the removal of ckpt-1 runs now, held back
        assert _names(manager.checkpoints) == ["ckpt-2"]
        assert latest_checkpoint(run) == f"{run}/ckpt-2"
        # Withdrawn before the save returned: no index under its name, so nothing opens
        # or adopts it (a manager adopts committed checkpoints only).
        assert not index_mod.is_committed(f"{run}/ckpt-1")
        gate.set()
        manager.sync()
        assert not [k for k in backend.keys(run) if k.startswith(("ckpt-1", ".ckpt-1"))]
        ckpt.w.fill_(3.0)
        handle = manager.save(async_save=True)
        manager.sync()  # the background save, then the removal of ckpt-2
        assert handle.done()
        assert not [k for k in backend.keys(run) if k.startswith(("ckpt-2", ".ckpt-2"))]
        restored = _ckpt()
        restored.restore(latest_checkpoint(run), COMM).assert_consumed()
        assert torch.equal(restored.w, torch.full((3,), 3.0))
    finally:
        gate.set()
        manager.close()

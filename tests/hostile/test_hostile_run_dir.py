"""``gc`` and retention on a crafted run directory: whatever its entries are (links out,
``..`` in names, FIFOs, sockets and devices, names that parse strangely, staging
directories with crafted owner files, trash that is a link, a pointer naming a link) and
whatever happens to them while gc runs (a directory swapped for a link), nothing outside
the run directory changes: the ``outside`` directory beside it is compared byte for
byte, with every entry's type, target and modification time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distckpt
from distckpt import CheckpointError
from distckpt.commit import staging
from distckpt.format import seal
from distckpt.testing.hostile import reseal
from tests.support.hostile_util import BOUND, cli
from tests.support.launch_util import bounded

OWNER = ".distckpt-owner.json"


def snapshot(top: Path) -> dict[str, Any]:
    """Every entry below ``top``: its type, modification time, and bytes or target."""
    out = {}
    for p in sorted([top, *top.rglob("*")]):
        st = p.lstat()
        what: Any = None
        if stat.S_ISREG(st.st_mode):
            what = p.read_bytes()
        elif stat.S_ISLNK(st.st_mode):
            what = os.readlink(p)
        out[str(p)] = (stat.S_IFMT(st.st_mode), st.st_mtime_ns, what)
    return out


def stale(path: Path) -> None:
    old = time.time() - 3600
    os.utime(path, (old, old), follow_symlinks=False)


def owned(directory: Path, doc: Any) -> Path:
    """A staging directory left an hour ago, whose owner file holds ``doc``."""
    directory.mkdir()
    raw = seal.encode(doc) if isinstance(doc, dict) else doc
    (directory / OWNER).write_bytes(raw)
    stale(directory / OWNER)
    stale(directory)
    return directory


def run_beside_outside(tmp_path: Path) -> tuple[Path, Path]:
    """``run`` (ckpt-1 and ckpt-2 of a manager, w = 0 and 1) beside ``outside`` (a
    checkpoint, a file and a directory, an hour old)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    distckpt.save({"w": torch.full((4,), 5.0)}, outside / "ckpt-1")
    (outside / "file").write_bytes(b"precious")
    (outside / "sub").mkdir()
    (outside / "sub" / "f").write_bytes(b"x")
    for p in [*outside.rglob("*"), outside]:
        stale(p)
    ckpt = distckpt.Checkpoint(w=torch.zeros(4))
    with distckpt.CheckpointManager(ckpt, run, max_to_keep=2) as manager:
        for i in range(2):
            ckpt.w.fill_(i)
            manager.save()
    return run, outside


def crafted_entries(run: Path, outside: Path) -> None:
    """Every crafted entry at once (none of which may stop a manager or gc)."""
    host = socket.gethostname()
    (run / ".ckpt-1.trash-ab").symlink_to(outside)  # trash that is a link
    (run / ".ckpt-3.staging-ab").symlink_to(outside / "sub")  # staging that is a link
    stale(run / ".ckpt-3.staging-ab")
    inner = owned(run / ".ckpt-4.staging-ab", {"host": "x", "pid": 1, "started": 0})
    (inner / "l").symlink_to(outside)  # links inside a leftover
    (inner / "f").symlink_to(outside / "file")
    (inner / "d").mkdir()
    (inner / "d" / "l").symlink_to(outside / "sub")
    (run / ".ckpt-5.trash-cd").mkdir()
    os.link(outside / "file", run / ".ckpt-5.trash-cd" / "hard")  # a hard link out
    stale(outside / "file")  # (the link changed its ctime, not its mtime)
    link_owner = run / ".ckpt-6.staging-ab"
    link_owner.mkdir()
    (link_owner / OWNER).symlink_to(outside / "file")
    stale(link_owner)
    fifo_owner = run / ".ckpt-7.staging-ab"
    fifo_owner.mkdir()
    os.mkfifo(fifo_owner / OWNER)
    stale(fifo_owner)
    owned(run / ".ckpt-8.staging-ab", b"[" * 100_000 + b"]" * 100_000)  # deep, not sealed
    owned(run / ".ckpt-9.staging-ab", {"host": host, "pid": 10**30, "started": "x"})
    owned(run / ".ckpt-10.staging-ab", {"host": host, "pid": -1, "started": 1e308})
    owned(run / ".ckpt-11.staging-ab", {"host": host, "pid": 0, "started": -1e308})
    future = owned(run / ".ckpt-12.staging-ab", {"host": host, "pid": os.getpid()})
    os.utime(future / OWNER, (time.time() + 1e8, time.time() + 1e8))  # a live-looking save
    complete = run / "....staging-ab"  # a complete checkpoint named as a leftover of ".."
    shutil.copytree(run / "ckpt-1", complete)
    stale(complete)
    for name in ("ckpt-13", ".ckpt-14.trash-ab", ".ckpt-15.staging-cd", "ckpt-\u0664"):
        os.mkfifo(run / name)
    for name in ("ckpt-16", ".ckpt-17.trash-ab"):
        socket.socket(socket.AF_UNIX).bind(str(run / name))
    for name in ("ckpt-18", ".ckpt-19.trash-ab"):
        with contextlib.suppress(PermissionError):  # (a container may forbid devices)
            os.mknod(run / name, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's
    for name in ("ckpt-0", "ckpt-20", "ckpt-05", "ckpt-99999999999999999999", "ckpt-1\n"):
        (run / name).symlink_to(outside / "ckpt-1")
    (run / "ckpt-2" / "evil").symlink_to(outside)  # links inside a checkpoint retired
    (run / "ckpt-2" / "w" / "evil").symlink_to(outside / "file")
    pointer = json.loads((run / "latest").read_bytes())
    pointer["all"] = ["ckpt-20", *pointer["all"]]  # a pointer naming a link out
    pointer["manager"]["times"]["../outside/ckpt-1"] = 0
    (run / "latest").write_bytes(reseal(json.dumps(pointer).encode()))


def test_gc_and_retention_touch_nothing_outside_a_crafted_run_directory(tmp_path: Path) -> None:
    run, outside = run_beside_outside(tmp_path)
    crafted_entries(run, outside)
    before = snapshot(outside)
    with bounded(BOUND * 2):
        first = cli("gc", run)
        assert first.returncode == 0 and not first.stderr, first
        ckpt = distckpt.Checkpoint(w=torch.zeros(4))
        with distckpt.CheckpointManager(ckpt, run, max_to_keep=1) as manager:
            assert manager.restore_or_initialize() == str(run / "ckpt-2")
            assert torch.equal(ckpt.w, torch.ones(4))
            for _ in range(3):
                manager.save()  # retention retires ckpt-2 (links inside), then the rest
        assert cli("gc", run).returncode == 0
        listed = cli("ls", run)  # links to checkpoints made it exit 2
        assert listed.returncode == 0, listed.stderr
        for entry in sorted(os.listdir(run)):
            with contextlib.suppress(CheckpointError):  # not a checkpoint: left alone
                distckpt.remove(run / entry)
    assert snapshot(outside) == before
    assert (run / ".ckpt-12.staging-ab").is_dir()  # a live-looking save is never removed
    assert (run / "ckpt-0").is_symlink() and (run / ".ckpt-1.trash-ab").is_symlink()


def swap_for_link(outside: Path) -> Callable[[Any, float], bool]:
    """``owner_alive`` that, once it has judged a leftover abandoned, swaps it for a link
    out: the moment between gc's look and its removal."""

    def judged(leftover: Any, stale_seconds: float = staging.STALE_SECONDS) -> bool:
        path = Path(leftover.url)
        shutil.rmtree(path)
        path.symlink_to(outside)
        return False

    return judged


def test_a_leftover_swapped_for_a_link_while_gc_runs_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, outside = run_beside_outside(tmp_path)
    owned(run / ".ckpt-3.staging-ab", {"host": "x", "pid": 1, "started": 0})
    before = snapshot(outside)
    monkeypatch.setattr(staging, "owner_alive", swap_for_link(outside))
    with bounded(BOUND):
        assert cli("gc", run).returncode == 0
    assert snapshot(outside) == before
    assert (run / ".ckpt-3.staging-ab").is_symlink()  # no longer a leftover: left alone


@pytest.mark.parametrize("entry", ["latest", ".latest.lock"])
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_pointer_or_lock_that_is_no_file_stops_the_manager_with_one_error(
    tmp_path: Path, entry: str, kind: str
) -> None:
    run, outside = run_beside_outside(tmp_path)
    (run / entry).unlink(missing_ok=True)
    if kind == "link":
        (run / entry).symlink_to(outside / "file")
    else:
        os.mkfifo(run / entry)
    before = snapshot(outside)
    ckpt = distckpt.Checkpoint(w=torch.zeros(4))
    with bounded(BOUND), pytest.raises(CheckpointError), distckpt.CheckpointManager(ckpt, run) as m:
        m.restore_or_initialize()
        m.save()
    with bounded(BOUND):
        assert cli("gc", run).returncode == 0
        assert cli("ls", run).returncode == 0
    assert snapshot(outside) == before

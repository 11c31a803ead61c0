"""Background (async) and lazy saves: values as of the call, errors never lost, bounded memory."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import distckpt
from distckpt.errors import CheckpointExists
from distckpt.pipeline import background
from tests.support.launch_util import SCRIPTS


@pytest.fixture(autouse=True)
def _no_pending_save() -> None:
    """Every test starts and ends with no background save left over."""
    background.finish_pending()
    yield
    with contextlib.suppress(Exception):  # a test of errors may leave one unseen
        background.finish_pending()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=gen)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for slot, v in opt.state[p].items():
            out[f"o/{i}/{slot}"] = v.clone()
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_engine_async_save_keeps_values_of_the_call(tmp_path: Path) -> None:
    w = torch.randn(300, 200)
    bf = torch.randn(64, dtype=torch.bfloat16)
    before = {"w": w.clone(), "bf": bf.clone()}
    handle = distckpt.save({"w": w, "bf": bf, "n": 3}, tmp_path / "a", async_save=True)
    w.mul_(2).add_(1)
    bf.zero_()
    result = handle.wait()
    assert handle.done() and result.path == (tmp_path / "a").absolute()
    assert set(result.timings) >= {"snapshot", "plan", "write", "commit", "total"}
    out = {"w": torch.zeros(300, 200), "bf": torch.zeros(64, dtype=torch.bfloat16), "n": 0}
    distckpt.load(out, tmp_path / "a")
    assert torch.equal(out["w"], before["w"]) and torch.equal(out["bf"], before["bf"])
    assert out["n"] == 3


def test_engine_lazy_save_copies_in_background(tmp_path: Path) -> None:
    w = torch.randn(500, 500)
    before = w.clone()
    handle = distckpt.save({"w": w}, tmp_path / "a", async_save=True, lazy=True)
    handle.wait_snapshot()
    w.fill_(5.0)
    handle.wait()
    out = {"w": torch.zeros(500, 500)}
    distckpt.load(out, tmp_path / "a")
    assert torch.equal(out["w"], before)


def test_lazy_needs_async() -> None:
    with pytest.raises(ValueError, match="async_save=True"):
        distckpt.save({"w": torch.zeros(2)}, "unused", lazy=True)


def test_background_error_raised_by_wait_and_only_once(tmp_path: Path) -> None:
    distckpt.save({"w": torch.zeros(2)}, tmp_path / "a")
    handle = distckpt.save({"w": torch.ones(2)}, tmp_path / "a", async_save=True)
    with pytest.raises(CheckpointExists):
        handle.wait()
    with pytest.raises(CheckpointExists):
        handle.wait()  # the handle keeps answering
    distckpt.save({"w": torch.ones(2)}, tmp_path / "b")  # seen once: the next call proceeds


def test_background_error_raised_at_next_call(tmp_path: Path) -> None:
    distckpt.save({"w": torch.zeros(2)}, tmp_path / "a")
    distckpt.save({"w": torch.ones(2)}, tmp_path / "a", async_save=True)  # fails in background
    with pytest.raises(CheckpointExists):
        distckpt.load({"w": torch.zeros(2)}, tmp_path / "a")
    out = {"w": torch.ones(2)}
    distckpt.load(out, tmp_path / "a")  # raised once; the old checkpoint is intact
    assert torch.equal(out["w"], torch.zeros(2))


def test_unsupported_value_fails_through_the_handle(tmp_path: Path) -> None:
    handle = distckpt.save({"w": torch.zeros(2), "o": object()}, tmp_path / "a", async_save=True)
    with pytest.raises(distckpt.errors.UnsupportedValueError, match="'o'"):
        handle.wait()
    assert not (tmp_path / "a").exists()


def test_next_save_waits_for_the_previous(tmp_path: Path) -> None:
    started = threading.Event()
    release = threading.Event()
    real = background.AsyncSave._run

    def slow_run(self: background.AsyncSave, body: object) -> None:
        started.set()
        release.wait(10)
        real(self, body)  # type: ignore[arg-type]

    background.AsyncSave._run = slow_run  # type: ignore[method-assign]
    try:
        first = distckpt.save({"w": torch.zeros(2)}, tmp_path / "a", async_save=True)
        started.wait(10)
        assert not first.done()
        threading.Timer(0.2, release.set).start()
        distckpt.save({"w": torch.ones(2)}, tmp_path / "b")  # waits for "a" first
        assert first.done()
    finally:
        background.AsyncSave._run = real  # type: ignore[method-assign]


def test_checkpoint_lazy_save_equals_state_at_save_time(tmp_path: Path) -> None:
    model, opt = _model()
    _train_step(model, opt, 1)
    step = torch.tensor(1)
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt, step=step)
    expected = _full_state(model, opt)
    handle = ckpt.save(tmp_path / "ckpt", lazy=True)
    assert isinstance(handle, distckpt.AsyncSave) and handle.path.endswith("ckpt-1")
    _train_step(model, opt, 2)  # forward (BatchNorm stats change), backward, step
    step.add_(1)
    changed = _full_state(model, opt)
    assert any(not torch.equal(changed[k], expected[k]) for k in expected)
    ckpt.sync()
    assert distckpt.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")

    model2, opt2 = _model()
    _train_step(model2, opt2, 7)  # different values, same structure
    step2 = torch.tensor(0)
    status = distckpt.Checkpoint(model=model2, optimizer=opt2, step=step2).restore(handle.path)
    status.assert_consumed()
    _assert_same(_full_state(model2, opt2), expected)
    assert int(step2) == 1


def test_manager_async_saves_apply_retention_in_order(tmp_path: Path) -> None:
    model, opt = _model()
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    saved: dict[str, dict[str, torch.Tensor]] = {}
    with distckpt.CheckpointManager(ckpt, tmp_path, max_to_keep=2) as manager:
        for i in range(4):
            _train_step(model, opt, i)
            handle = manager.save(async_save=True, lazy=i % 2 == 1)
            saved[Path(handle.path).name] = _full_state(model, opt)
        manager.sync()
        assert [Path(p).name for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
        assert manager.latest_checkpoint == str(tmp_path / "ckpt-4")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "ckpt-3",
        "ckpt-4",
        "latest",
    ]
    for name in ("ckpt-3", "ckpt-4"):
        model2, opt2 = _model()
        _train_step(model2, opt2, 9)
        distckpt.Checkpoint(model=model2, optimizer=opt2).restore(tmp_path / name)
        _assert_same(_full_state(model2, opt2), saved[name])


def test_manager_failed_async_save_is_raised_and_counter_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from distckpt.storage.posix import PosixStore

    model, opt = _model()
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    with distckpt.CheckpointManager(ckpt, tmp_path) as manager:
        manager.save(async_save=True)
        manager.sync()

        def full(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(PosixStore, "create", full)
        manager.save(async_save=True)
        with pytest.raises(OSError, match="No space left"):
            manager.sync()
        assert ckpt.save_counter == 1 and manager.latest_checkpoint == str(tmp_path / "ckpt-1")
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
            "ckpt-1",
            "latest",
        ]
        monkeypatch.undo()
        assert manager.save().endswith("ckpt-2")


_RSS_SCRIPT = """
import sys, torch, distckpt
from pathlib import Path

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB
opt = torch.optim.Adam(model.parameters())
model(torch.ones(1, 512)).sum().backward(); opt.step()
ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
manager = distckpt.CheckpointManager(ckpt, sys.argv[1], max_to_keep=2)
marks = {}
for i in range(1, 51):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.001)
    manager.save(async_save=True, lazy=i % 2 == 0)
    if i in (10, 50):
        manager.sync()
        marks[i] = rss()
manager.close()
print("RSS", marks[10], marks[50])
"""


def test_resident_memory_does_not_grow_over_50_async_saves(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "rss.py"
    script.write_text(_RSS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RSS")][0]
    at10, at50 = (int(x) for x in line.split()[1:])
    # The state is 24 MiB (weights and two Adam slots); one more snapshot would be +24 MiB.
    assert at50 - at10 < 6 * 2**20, f"resident memory grew by {(at50 - at10) / 2**20:.1f} MiB"


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_async_save_on_several_ranks(tmp_path: Path, launcher: str) -> None:
    from tests.support.launch_util import check, run_mpi_ranks, run_ranks

    if launcher == "mpiexec":
        proc = run_mpi_ranks(3, SCRIPTS / "async_save.py", str(tmp_path), timeout=180)
        world = 3
    else:
        proc = run_ranks(2, SCRIPTS / "async_save.py", str(tmp_path), timeout=180)
        world = 2
    check(proc)
    for rank in range(world):
        assert f"OK {rank}\n" in proc.stdout, proc.stdout


def test_declared_in_place_change_waits_for_the_lazy_copy(tmp_path: Path) -> None:
    model, opt = _model()
    _train_step(model, opt, 1)
    ckpt = distckpt.Checkpoint(model=model, optimizer=opt)
    expected = _full_state(model, opt)
    waited: list[bool] = []
    real = background.snapshot_barrier

    def spy() -> None:
        waited.append(True)
        real()

    @distckpt.before_change
    def clamp_weights() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.01, 0.01)  # in place, outside optimizer.step()

    background.snapshot_barrier = spy  # type: ignore[assignment]
    try:
        handle = ckpt.save(tmp_path / "ckpt", lazy=True)
        clamp_weights()
    finally:
        background.snapshot_barrier = real  # type: ignore[assignment]
    assert waited, "the decorated function did not wait for the snapshot"
    handle.wait()
    model2, opt2 = _model()
    _train_step(model2, opt2, 3)
    distckpt.Checkpoint(model=model2, optimizer=opt2).restore(handle.path).assert_consumed()
    _assert_same(_full_state(model2, opt2), expected)

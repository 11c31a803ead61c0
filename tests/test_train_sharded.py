"""examples/train_sharded.py: FSDP2 training that resumes after an interruption, on the
same or another world size (gloo on CPU; mpiexec, torchrun and one process).

* A run on 4 ranks (mpiexec) stops after 10 of 20 steps, saving at 5 and 10 and dumping
  its full state (parameters and AdamW slots) at 10. Restored on 1, 2 and 3 ranks, the
  parameters and the optimizer state are bit-identical to that dump (checked inside the
  restored run, right after the restore).
* On 2 ranks, 20 steps straight and 10 + 10 steps with a relaunch in between end
  bit-identical.
* The loss scaling: on 3 ranks the first step's full gradients are those of the mean
  over the global batch (AdamW hardly sees a wrong scale, so the parameters could not
  tell).
* 4 ranks for 10 steps, then 2 ranks for 10 more end where 4 ranks for 20 steps end, up
  to float rounding (the reduction order differs with the world size).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from launch_util import (
    HAVE_MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    check,
    output,
    run_mpi,
    run_single,
    run_torchrun,
)

SCRIPT = REPO_ROOT / "examples" / "train_sharded.py"
TIMEOUT = 150  # seconds, per launch
COMMON = ("--steps", "20", "--every", "5", "--global-batch", "12")


def _launch(launcher: str, n: int, *args: str):
    if launcher == "python":
        assert n == 1
        return run_single(SCRIPT, *args, timeout=TIMEOUT)
    if launcher == "mpiexec":
        return run_mpi(n, SCRIPT, *args, timeout=TIMEOUT)
    return run_torchrun(n, SCRIPT, *args, timeout=TIMEOUT)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _assert_identical(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), f"{key} differs"
        else:
            assert got[key] == value, key


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks (mpiexec) stopped after 10 of 20 steps; saved at 5 and 10; dump at 10."""
    launcher = "mpiexec" if HAVE_MPIEXEC else "torchrun"  # no mpiexec: the same job
    root = tmp_path_factory.mktemp("saved_on_4")
    proc = _launch(
        launcher, 4, "--dir", str(root / "run"), *COMMON,
        "--stop-after", "10", "--dump", str(root / "step10.pt"),
    )  # fmt: skip
    check(proc)
    out = proc.stdout
    assert out.count("Initializing from scratch.") == 1, output(proc)
    assert "saved " + str(root / "run" / "ckpt-1") in out, output(proc)
    assert "saved " + str(root / "run" / "ckpt-2") in out, output(proc)
    assert "end of run" not in out and "Done: step 10 on 4 rank(s)." in out, output(proc)
    assert _load(root / "step10.pt")["step"] == 10
    return root


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("launcher", "n"), [("python", 1), ("torchrun", 2), ("torchrun", 3)])
def test_restore_on_another_world_size_is_bit_identical(
    saved_on_4: Path, tmp_path: Path, launcher: str, n: int
) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_on_4 / "run", run)
    dump = saved_on_4 / "step10.pt"
    # --steps 10: restore, check against the dump, train nothing, save nothing
    proc = _launch(
        launcher, n, "--dir", str(run), "--steps", "10", "--every", "5",
        "--check-restore-against", str(dump), "--dump", str(tmp_path / "after.pt"),
    )  # fmt: skip
    check(proc)
    out = proc.stdout
    restored = f"Restored from {run / 'ckpt-2'} at step 10 onto {n} rank(s)."
    assert out.count(restored) == 1, output(proc)
    assert out.count("Restore check passed: 24 tensors bit-identical.") == 1, output(proc)
    assert "saved" not in out, output(proc)
    # the same state gathered again after the run (and written by the test's own reader)
    _assert_identical(_load(tmp_path / "after.pt"), _load(dump))
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-1",
        "ckpt-2",
    ]


@pytest.mark.timeout(300)
def test_interrupted_equals_uninterrupted_on_2_ranks(tmp_path: Path) -> None:
    straight = _launch(
        "torchrun", 2, "--dir", str(tmp_path / "a"), *COMMON, "--dump", str(tmp_path / "a.pt")
    )
    check(straight)
    assert straight.stdout.count("Initializing from scratch.") == 1, output(straight)

    interrupted_launcher = "mpiexec" if HAVE_MPIEXEC else "torchrun"
    first = _launch(interrupted_launcher, 2, "--dir", str(tmp_path / "b"), *COMMON,
                    "--stop-after", "10")  # fmt: skip
    check(first)
    assert "Done: step 10 on 2 rank(s)." in first.stdout, output(first)
    second = _launch(
        "torchrun", 2, "--dir", str(tmp_path / "b"), *COMMON, "--dump", str(tmp_path / "b.pt")
    )
    check(second)
    assert second.stdout.count(f"Restored from {tmp_path / 'b' / 'ckpt-2'} at step 10") == 1, (
        output(second)
    )
    assert "saved " + str(tmp_path / "b" / "ckpt-4") in second.stdout, output(second)

    a, b = _load(tmp_path / "a.pt"), _load(tmp_path / "b.pt")
    assert a["step"] == b["step"] == 20
    _assert_identical(b, a)


@pytest.mark.timeout(300)
def test_continue_on_another_world_size(saved_on_4: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_on_4 / "run", run)
    resumed = _launch(
        "torchrun", 2, "--dir", str(run), *COMMON,
        "--check-restore-against", str(saved_on_4 / "step10.pt"),
        "--dump", str(tmp_path / "resumed.pt"),
    )  # fmt: skip
    check(resumed)
    assert "Restore check passed" in resumed.stdout, output(resumed)
    straight = _launch(
        "torchrun", 4, "--dir", str(tmp_path / "straight"), *COMMON,
        "--dump", str(tmp_path / "straight.pt"),
    )  # fmt: skip
    check(straight)

    got, want = _load(tmp_path / "resumed.pt"), _load(tmp_path / "straight.pt")
    assert got["step"] == want["step"] == 20
    names = sorted(k for k in want if k.startswith("param:"))
    assert names and sorted(k for k in got if k.startswith("param:")) == names
    diff = torch.cat([(got[k] - want[k]).flatten() for k in names]).norm()
    norm = torch.cat([want[k].flatten() for k in names]).norm()
    assert diff <= 1e-6 * norm, (diff.item(), norm.item())
    assert got["opt:0.weight:step"] == want["opt:0.weight:step"]


@pytest.mark.timeout(200)
def test_gradients_are_the_global_batch_mean_on_3_ranks() -> None:
    script = SCRIPTS / "train_sharded_check.py"
    if HAVE_MPIEXEC:
        proc = run_mpi(3, script, timeout=TIMEOUT)
    else:
        proc = run_torchrun(3, script, timeout=TIMEOUT)
    check(proc)
    assert proc.stdout.count("OK gradients 3") == 1, output(proc)

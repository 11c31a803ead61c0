"""examples/train_sharded.py: FSDP2 training that resumes after an interruption, on the
same or another world size (gloo on CPU; mpiexec, torchrun and one process).

* A run on 4 ranks (mpiexec) stops after 10 of 20 steps, saving at 5 and 10 and dumping
  its full state (parameters and AdamW slots) at 10. Restored on 1, 2 and 3 ranks, the
  parameters and the optimizer state are bit-identical to that dump (checked inside the
  restored run, right after the restore).
* The loss scaling: on 3 ranks the first step's full gradients are those of the mean
  over the global batch (AdamW hardly sees a wrong scale, so the parameters could not
  tell).

An interrupted run that resumes on the same world size ends bit-identical to an
uninterrupted one, and one that continues on another world size ends where it would
have up to float rounding: tests/training/test_elastic.py (a real preemption, 4 -> 4 and 4 -> 2
-> 3).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.launch_util import (
    HAVE_MPIEXEC,
    REPO_ROOT,
    SCRIPTS,
    check,
    output,
    run_mpi_ranks,
    run_ranks,
    run_single,
)

SCRIPT = REPO_ROOT / "examples" / "train_sharded.py"
TIMEOUT = 150  # seconds, per launch
COMMON = ("--steps", "20", "--every", "5", "--global-batch", "12")


def _launch(launcher: str, n: int, *args: str):
    if launcher == "python":
        assert n == 1
        return run_single(SCRIPT, *args, timeout=TIMEOUT)
    if launcher == "mpiexec":
        return run_mpi_ranks(n, SCRIPT, *args, timeout=TIMEOUT)
    return run_ranks(n, SCRIPT, *args, timeout=TIMEOUT)


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


@pytest.mark.timeout(200)
def test_gradients_are_the_global_batch_mean_on_3_ranks() -> None:
    script = SCRIPTS / "train_sharded_check.py"
    if HAVE_MPIEXEC:
        proc = run_mpi_ranks(3, script, timeout=TIMEOUT)
    else:
        proc = run_ranks(3, script, timeout=TIMEOUT)
    check(proc)
    assert proc.stdout.count("OK gradients 3") == 1, output(proc)

"""PreemptionHandler in one process (several ranks: tests/training/test_elastic.py, test_slurm.py).

Signal handlers change process-wide state, so each case runs in a child process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import json, os, signal, sys, time
import torch
import distckpt

run, marker, mode = sys.argv[1], sys.argv[2], sys.argv[3]
step = torch.tensor(0)
w = torch.zeros(1000)
ckpt = distckpt.Checkpoint(step=step, w=w)
manager = distckpt.CheckpointManager(ckpt, run, max_to_keep=3, step_counter=step)
restored = manager.restore_or_initialize()
print("start", int(step), flush=True)
handler = distckpt.PreemptionHandler(manager, check_every=int(os.environ.get("EVERY", "1")))
handler.install()
while int(step) < 50:
    step.add_(1)
    w.add_(1.0)
    if int(step) % 5 == 0:
        manager.save(async_save=True)          # a background save may be running
    if int(step) == 12 and mode == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    if handler.save_if_preempted():
        print("preempted", int(step), handler.checkpoint, flush=True)
        break
handler.uninstall()
manager.close()
if handler.preempted:
    os.kill(os.getpid(), signal.SIGTERM)       # a late copy of the notice: ignored
    time.sleep(0.2)
handler.exit_if_preempted()
print("done", int(step), flush=True)
"""


def _run(tmp_path: Path, mode: str, every: int = 1) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", EVERY=str(every), DISTCKPT_PREEMPTED_FILE="")
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run"), str(tmp_path / "marker"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "DISTCKPT_PREEMPTED_FILE": str(tmp_path / "marker")},
    )


def test_signal_saves_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    import distckpt

    proc = _run(tmp_path, "signal")
    assert proc.returncode == distckpt.EXIT_PREEMPTED == 75, proc.stdout + proc.stderr
    assert "preempted 12 " in proc.stdout, proc.stdout + proc.stderr
    marker = json.loads((tmp_path / "marker").read_text())
    assert marker == {
        "step": 12,
        "checkpoint": str(tmp_path / "run" / "ckpt-3"),
        "signal": "SIGUSR1",
    }
    assert distckpt.latest_checkpoint(tmp_path / "run") == marker["checkpoint"]
    import torch

    out = {"step": torch.tensor(0), "w": torch.zeros(1000)}
    distckpt.Checkpoint(**out).restore(marker["checkpoint"]).expect_partial()
    assert int(out["step"]) == 12 and torch.equal(out["w"], torch.full((1000,), 12.0))

    again = _run(tmp_path, "none")  # resumes from the preemption's checkpoint
    assert again.returncode == 0, again.stdout + again.stderr
    assert "start 12" in again.stdout and "done 50" in again.stdout, again.stdout


def test_check_every_delays_the_agreement(tmp_path: Path) -> None:
    proc = _run(tmp_path, "signal", every=4)
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "preempted 12 " in proc.stdout or "preempted 16 " in proc.stdout, proc.stdout


def test_no_signal_no_preemption(tmp_path: Path) -> None:
    proc = _run(tmp_path, "none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done 50" in proc.stdout and not (tmp_path / "marker").exists()


def test_bad_check_every() -> None:
    import distckpt

    with pytest.raises(ValueError, match="check_every"):
        distckpt.PreemptionHandler(object(), check_every=0)  # type: ignore[arg-type]


def test_handlers_restored_when_not_preempted(tmp_path: Path) -> None:
    import torch

    import distckpt

    before = signal.getsignal(signal.SIGUSR1)
    ckpt = distckpt.Checkpoint(w=torch.zeros(2))
    with distckpt.CheckpointManager(ckpt, tmp_path) as manager:
        with distckpt.PreemptionHandler(manager) as handler:
            assert signal.getsignal(signal.SIGUSR1) != before
            assert not handler.save_if_preempted()
        assert signal.getsignal(signal.SIGUSR1) == before
